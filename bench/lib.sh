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
