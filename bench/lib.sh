# lib.sh -- sourced by the bench shell scripts (switches.sh, sets-ab.sh,
# epoll-sets.sh, affinity.sh, layers.sh, quota-ab.sh, checkouts-ab.sh,
# at-rest.sh, pool-caps.sh, setup-switches.sh): the steps they all take.
#
#   ready_pid FILE         waits (up to 120 s) for the line "READY <pid>" that
#                          bench/server.lisp or bench/layers-server.lisp
#                          prints once it listens, in FILE (its standard
#                          output); prints the pid, or nothing if it never came
#   cpu_ticks PIDS...      the clock ticks (utime + stime, /proc/PID/stat
#                          fields 14 and 15, every thread) of the processes
#                          PIDS, summed; each argument is a pid or a
#                          comma-separated list of them (nginx's master and
#                          workers)
#   cpu_user_system PIDS...  the same, as two numbers: "USER SYSTEM"
#   start_server I OPTIONS KIND PORT SLEEP_MS
#                          starts bench/server.lisp (KIND PORT SLEEP_MS) from
#                          $HERE in the background, with BENCH_GALLOP_OPTIONS
#                          set to OPTIONS, its output in $TMP/serverI.out and
#                          .err, and as its standard input a FIFO this shell
#                          holds open, so that the server exits with the
#                          script; adds the background job to KIDS
#   await_servers N NAME   waits for servers 0 to N-1 (start_server) to
#                          listen and adds their pids to PIDS; on one that
#                          never does, says so as NAME and exits
ready_pid() {
  local i
  for i in $(seq 240); do grep -q READY "$1" 2>/dev/null && break; sleep 0.5; done
  awk '/READY/{print $2; exit}' "$1" 2>/dev/null
}
cpu_user_system() {
  local u=0 s=0 p pu ps
  for p in ${*//,/ }; do
    read -r pu ps < <(awk '{print $14, $15}' "/proc/$p/stat")
    u=$((u + pu)); s=$((s + ps))
  done
  echo "$u $s"
}
cpu_ticks() {
  local u s
  read -r u s < <(cpu_user_system "$@")
  echo $((u + s))
}
start_server() {
  local i=$1 options=$2 fd
  rm -f "$TMP/hold$i"; mkfifo "$TMP/hold$i"; exec {fd}<> "$TMP/hold$i"
  (cd "$HERE" && BENCH_GALLOP_OPTIONS="$options" exec scripts/lisp.sh --load bench/server.lisp \
     --end-toplevel-options "$3" "$4" "$5" < "$TMP/hold$i" > "$TMP/server$i.out" 2> "$TMP/server$i.err") &
  KIDS+=($!)
}
await_servers() {
  local i pid
  for i in $(seq 0 $(($1 - 1))); do
    pid=$(ready_pid "$TMP/server$i.out")
    [ -n "$pid" ] || { echo "$2: server $i did not start (see $TMP/server$i.err)" >&2; exit 1; }
    PIDS+=("$pid")
  done
}
