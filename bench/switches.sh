#!/bin/bash
# switches.sh -- what a request costs gallop:start and nginx in the shared
# setup, beyond CPU time: context switches and CPU migrations per request.
#
#   [DURATION=4] [REPS=3] [CONNS_LIST="10 100 400"] bench/switches.sh
#
# gallop:start (bench/server.lisp, native, 0 ms, its defaults) and nginx with
# a worker per CPU, nothing pinned.  For each round, count and server in turn:
# `wrk -t2 -cN -dDURATION`, and from 0.5 s into it `perf stat -e
# context-switches,cpu-migrations` on the server's processes (nginx: master
# and workers) for DURATION - 1 seconds.  One line per run: req/s; server
# CPU µs per request (utime + stime from /proc over the wrk run), and its
# user part; context switches and migrations per request (perf's counts
# over its window ÷ the requests of that window at the run's rate); for
# Gallop, the events its workers stole from another group's set or queue
# (:STOLEN in GALLOP:STATS) per request.  Ports 18981, 18982.  Needs wrk,
# nginx and perf (scripts/deps.sh wrk nginx-light linux-perf).
# doc/design.md, "Stealing between groups".
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
DUR=${DURATION:-4}; REPS=${REPS:-3}; CONNS_LIST=${CONNS_LIST:-"10 100 400"}
TMP=$HERE/bench/results/tmp/switches; mkdir -p "$TMP"
rm -f "$TMP/hold"; mkfifo "$TMP/hold"; exec 9<> "$TMP/hold"
# Standard input is a FIFO this script holds: the server exits with it.
(cd "$HERE" && exec scripts/lisp.sh --load bench/server.lisp \
   --end-toplevel-options native 18981 0 < "$TMP/hold" > "$TMP/gallop.out" 2> "$TMP/gallop.err") &
KID=$!
. "$HERE/bench/nginx-yo.sh"
. "$HERE/bench/lib.sh"
nginx_yo_conf "$TMP/nginx" 18982 "$(nproc)"
nginx -c "$TMP/nginx/nginx.conf" -e "$TMP/nginx/error.log" || { kill "$KID"; exit 1; }
trap 'kill "$KID" 2>/dev/null; kill "$(cat "$TMP/nginx/nginx.pid")" 2>/dev/null' EXIT
GALLOP=$(ready_pid "$TMP/gallop.out")
[ -n "$GALLOP" ] || { echo "switches.sh: gallop:start did not start (see $TMP/gallop.err)" >&2; exit 1; }
sleep 0.5
MASTER=$(cat "$TMP/nginx/nginx.pid")
NGINX="$MASTER,$(pgrep -P "$MASTER" | paste -sd,)"
hz=$(getconf CLK_TCK)
# Gallop's :STOLEN count (GALLOP:STATS, through the server's protocol).
stolen() { local n; n=$(grep -c STATS "$TMP/gallop.out"); echo stats >&9
           for i in $(seq 50); do [ "$(grep -c STATS "$TMP/gallop.out")" -gt "$n" ] && break; sleep 0.02; done
           grep STATS "$TMP/gallop.out" | tail -1 | sed 's/.*:STOLEN \([0-9]*\).*/\1/'; }
for port in 18981 18982; do wrk -t2 -c400 -d1s "http://127.0.0.1:$port/yo" > /dev/null; done
for r in $(seq "$REPS"); do
  for c in $CONNS_LIST; do
    for port in 18981 18982; do
      if [ "$port" = 18981 ]; then name=gallop; pids=$GALLOP; else name=nginx; pids=$NGINX; fi
      [ "$name" = gallop ] && st0=$(stolen)
      read -r u0 s0 < <(cpu_user_system "$pids")
      wrk -t2 -c"$c" -d"${DUR}s" "http://127.0.0.1:$port/yo" > "$TMP/wrk.txt" &
      wrk_pid=$!
      sleep 0.5
      perf stat -e context-switches,cpu-migrations -p "$pids" -o "$TMP/perf.txt" -- sleep $((DUR - 1)) > /dev/null 2>&1
      wait "$wrk_pid"
      read -r u1 s1 < <(cpu_user_system "$pids")
      stolen_per_req=""
      [ "$name" = gallop ] && stolen_per_req=$(awk -v n="$(( $(stolen) - st0 ))" '/requests in/ { printf " %.3f stolen/req", n / $1 }' "$TMP/wrk.txt")
      awk -v r="$r" -v c="$c" -v n="$name" -v d="$DUR" -v u="$((u1 - u0))" -v s="$((s1 - s0))" -v hz="$hz" \
          -v cs="$(awk '/context-switches/ { gsub(",", "", $1); print $1 }' "$TMP/perf.txt")" \
          -v mig="$(awk '/cpu-migrations/ { gsub(",", "", $1); print $1 }' "$TMP/perf.txt")" -v st="$stolen_per_req" \
        '/requests in/ { rate = $1 / d; window = rate * (d - 1)
                         printf "%d c%-4s %-6s %7.0f req/s %6.2f us/req (user %5.2f) %.3f switches/req %.4f migrations/req%s\n",
                                r, c, n, rate, (u + s) * 1e6 / hz / $1, u * 1e6 / hz / $1, cs / window, mig / window, st }' \
          "$TMP/wrk.txt"
    done
  done
done
