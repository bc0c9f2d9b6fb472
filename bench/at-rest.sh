#!/bin/bash
# at-rest.sh -- what an idle server costs: CPU and wake-ups while nobody
# sends it anything, Gallop's front ends beside stock Hunchentoot and nginx.
#
#   [SECONDS_IDLE=30] [KINDS="native gallop gallop-tm stock"] [CHECKOUT=.] \
#     bench/at-rest.sh
#
# Each KIND in turn (bench/server.lisp, 0 ms, its defaults, from CHECKOUT:
# default this checkout), then nginx with a worker per CPU: one request
# (curl), 3 s of quiet, then SECONDS_IDLE seconds with no client.  One line
# per server: the clock ticks (utime + stime, every thread, /proc/PID/stat)
# it used in that time and the share of one CPU they make, and the context
# switches of its threads (voluntary and not, /proc/PID/task/*/status), in
# all and per second; for the Lisp servers, the same per thread name (the
# kernel names Gallop's threads: "gallop maker", "gallop keeper", "gallop
# worker").  Port 18991.  Needs curl and nginx (scripts/deps.sh curl
# nginx-light).  doc/design.md, "A pool at rest".
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
CHECKOUT=${CHECKOUT:-$HERE}
IDLE=${SECONDS_IDLE:-30}
KINDS=${KINDS:-"native gallop gallop-tm stock"}
TMP=$HERE/bench/results/tmp/at-rest; mkdir -p "$TMP"
. "$HERE/bench/nginx-yo.sh"
. "$HERE/bench/lib.sh"
hz=$(getconf CLK_TCK)

# "NAME SWITCHES" for each thread of the processes PIDS (space-separated).
thread_switches() {
  local p t
  for p in "$@"; do
    for t in /proc/"$p"/task/*; do
      echo "$(tr ' ' _ < "$t/comm") $(awk '/ctxt_switches/ {n += $2} END {print n}' "$t/status")"
    done
  done
}

# Measure the processes PIDS for IDLE seconds; print one line for LABEL, and
# with PER_THREAD, one per thread name.
measure() {
  local label=$1 per_thread=$2; shift 2
  local t0 t1
  thread_switches "$@" > "$TMP/before"
  t0=$(cpu_ticks "$@")
  sleep "$IDLE"
  t1=$(cpu_ticks "$@")
  thread_switches "$@" > "$TMP/after"
  paste "$TMP/before" "$TMP/after" \
    | awk -v l="$label" -v t=$((t1 - t0)) -v hz="$hz" -v s="$IDLE" -v per="$per_thread" '
        { n[$1] += $4 - $2; all += $4 - $2 }
        END { printf "%-10s %4d ticks in %d s  %6.3f%% of a CPU  %6d switches  %7.1f/s\n",
                     l, t, s, 100 * t / hz / s, all, all / s
              if (per) for (k in n) printf "  %-16s %6d switches %7.1f/s\n", k, n[k], n[k] / s }'
}

for kind in $KINDS; do
  rm -f "$TMP/hold"; mkfifo "$TMP/hold"; exec 9<> "$TMP/hold"
  # Standard input is a FIFO this script holds: the server exits with it.
  (cd "$CHECKOUT" && exec scripts/lisp.sh --load bench/server.lisp \
     --end-toplevel-options "$kind" 18991 0 < "$TMP/hold" > "$TMP/$kind.out" 2> "$TMP/$kind.err") &
  pid=$(ready_pid "$TMP/$kind.out")
  [ -n "$pid" ] || { echo "at-rest.sh: $kind did not start (see $TMP/$kind.err)" >&2; exit 1; }
  curl -s -o /dev/null http://127.0.0.1:18991/yo
  sleep 3
  measure "$kind" 1 "$pid"
  echo quit >&9
  exec 9>&-
  wait
done

nginx_yo_conf "$TMP/nginx" 18991 "$(nproc)"
nginx -c "$TMP/nginx/nginx.conf" -e "$TMP/nginx/error.log" || exit 1
trap 'kill "$(cat "$TMP/nginx/nginx.pid")" 2>/dev/null' EXIT
sleep 1
MASTER=$(cat "$TMP/nginx/nginx.pid")
curl -s -o /dev/null http://127.0.0.1:18991/yo
sleep 3
measure nginx "" "$MASTER" $(pgrep -P "$MASTER")
