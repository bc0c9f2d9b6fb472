#!/bin/bash
# epoll-sets.sh -- what the pool's epoll set per CPU brings, in one run.
#
#   [DURATION=4] [REPS=5] [CONNS_LIST="10 100 400"] [KIND=native] [SLEEP_MS=0] bench/epoll-sets.sh
#
# Three servers side by side, nothing pinned (the shared setup): `sets1`, a
# gallop:start server (bench/server.lisp, native, 0 ms; KIND=gallop: the
# drop-in GALLOP:EASY-ACCEPTOR; SLEEP_MS: its handler sleeps that long, nginx
# still answers at once) whose pool has one epoll set for all its
# workers (GALLOP_EPOLL_SETS=1, the pool before groups); `setsN`, the same
# with one epoll set per usable CPU (GALLOP_EPOLL_SETS=cpus, the default);
# and nginx with a worker per CPU.  For each of REPS rounds and each
# connection count, `wrk -t2 -cN` against each in turn (interleaved, in
# the reverse order on even rounds); prints
# each run's req/s and the server's CPU microseconds per request (utime +
# stime from /proc over the run), then per round the ratios setsN/sets1 and
# setsN/nginx, and their medians.  Ports 18961..18963.  Needs wrk and nginx
# (scripts/deps.sh wrk nginx-light).  doc/design.md, "An epoll set per CPU".
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
DUR=${DURATION:-4}; REPS=${REPS:-5}; CONNS_LIST=${CONNS_LIST:-"10 100 400"}; KIND=${KIND:-native}; SLEEP_MS=${SLEEP_MS:-0}
TMP=$HERE/bench/results/tmp/epoll-sets; mkdir -p "$TMP"
rm -f "$TMP/hold"; mkfifo "$TMP/hold"; exec 9<> "$TMP/hold"
KIDS=()
cleanup() {
  for k in "${KIDS[@]}"; do kill "$k" 2>/dev/null; done
  [ -f "$TMP/nginx/nginx.pid" ] && kill "$(cat "$TMP/nginx/nginx.pid")" 2>/dev/null
  for k in "${KIDS[@]}"; do wait "$k" 2>/dev/null; done
}
trap cleanup EXIT
start() { # PORT SETS (a number, or cpus)
  # Its standard input is a FIFO this script holds open (fd 9): the server
  # exits at end of file, when this script does, whatever ends it.
  (cd "$HERE" && exec env GALLOP_EPOLL_SETS="$2" scripts/lisp.sh --load bench/server.lisp \
     --end-toplevel-options "$KIND" "$1" "$SLEEP_MS" < "$TMP/hold" > "$TMP/$1.out" 2> "$TMP/$1.err") &
  KIDS+=($!)
}
# Compiled once first: two servers compiling into one cache at once can
# load each other's half-written files.
(cd "$HERE" && scripts/lisp.sh --eval '(asdf:load-system "gallop")' \
   --eval '(asdf:load-system "gallop/native")' > /dev/null 2>&1) \
  || { echo "epoll-sets.sh: Gallop does not compile" >&2; exit 1; }
start 18961 1
start 18962 cpus
. "$HERE/bench/nginx-yo.sh"
. "$HERE/bench/lib.sh"
nginx_yo_conf "$TMP/nginx" 18963 "$(nproc)"
nginx -c "$TMP/nginx/nginx.conf" -e "$TMP/nginx/error.log" || exit 1
declare -A PID
for port in 18961 18962; do
  PID[$port]=$(ready_pid "$TMP/$port.out")
  [ -n "${PID[$port]}" ] || { echo "epoll-sets.sh: server on $port did not start (see $TMP/$port.err)" >&2; exit 1; }
done
sleep 0.5
master=$(cat "$TMP/nginx/nginx.pid")
PID[18963]="$master $(pgrep -P "$master" | tr '\n' ' ')"
hz=$(getconf CLK_TCK)
NAME=([18961]=sets1 [18962]=setsN [18963]=nginx)
for port in 18961 18962 18963; do wrk -t2 -c400 -d1s "http://127.0.0.1:$port/yo" > /dev/null; done
: > "$TMP/runs"
for r in $(seq "$REPS"); do
  # Even rounds go the other way, so that neither server always runs first
  # (or right after nginx): the host's state drifts within a round too.
  ORDER="18961 18962 18963"; [ $((r % 2)) = 0 ] && ORDER="18963 18962 18961"
  for c in $CONNS_LIST; do
    for port in $ORDER; do
      T0=$(cpu_ticks ${PID[$port]})
      wrk -t2 -c"$c" -d"${DUR}s" "http://127.0.0.1:$port/yo" > "$TMP/wrk.txt"
      T1=$(cpu_ticks ${PID[$port]})
      awk -v n="${NAME[$port]}" -v r="$r" -v c="$c" -v t="$((T1 - T0))" -v d="$DUR" -v hz="$hz" \
        '/requests in/ { printf "%d c%-4s %-6s %9.0f req/s %6.2f us/req\n", r, c, n, $1 / d, t * 1e6 / hz / $1 }' \
        "$TMP/wrk.txt" | tee -a "$TMP/runs"
    done
  done
done
median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
for c in $CONNS_LIST; do
  # Per round: setsN/sets1 and setsN/nginx, in req/s and in CPU per request.
  awk -v c="c$c" '$2 == c { rate[$1 "," $3] = $4; cpu[$1 "," $3] = $6; if ($1 > n) n = $1 }
    END { for (r = 1; r <= n; r++)
            printf "%s %.3f %.3f %.3f %.3f\n", c, rate[r ",setsN"] / rate[r ",sets1"],
                   rate[r ",setsN"] / rate[r ",nginx"], cpu[r ",setsN"] / cpu[r ",sets1"],
                   cpu[r ",setsN"] / cpu[r ",nginx"] }' "$TMP/runs" > "$TMP/ratios.$c"
  printf "c%-4s median of %s rounds: req/s setsN/sets1 %s, setsN/nginx %s; CPU/req setsN/sets1 %s, setsN/nginx %s\n" \
    "$c" "$REPS" "$(awk '{print $2}' "$TMP/ratios.$c" | median)" "$(awk '{print $3}' "$TMP/ratios.$c" | median)" \
    "$(awk '{print $4}' "$TMP/ratios.$c" | median)" "$(awk '{print $5}' "$TMP/ratios.$c" | median)"
done
