#!/bin/bash
# affinity.sh -- what an epoll set per core would buy, emulated with processes.
#
#   [DURATION=4] [REPS=7] [CONNS=400] bench/affinity.sh
#
# `one`: one gallop:start server (bench/server.lisp, native) with its default
# pool, loaded by `wrk -t2 -cCONNS`.  `split`: two gallop:start servers of one
# worker each (:max-thread-count 1 :standby-thread-count 1), each with its own
# epoll set, listen socket and connections, each loaded by its own
# `wrk -t1 -c(CONNS/2)` at the same time: what one process with an epoll set
# and a worker per core, and connections that never change cores, would do.
# Nothing is pinned (the shared setup).  REPS rounds, interleaved; prints each
# round's req/s and the servers' CPU microseconds per request (/proc/PID/stat
# over the run, summed over both servers for `split`), then the medians.
# Ports 18951..18953.  Needs wrk (scripts/deps.sh wrk).  doc/design.md, "An
# epoll set per CPU".
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
. "$HERE/bench/lib.sh"
DUR=${DURATION:-4}; REPS=${REPS:-7}; CONNS=${CONNS:-400}
TMP=$HERE/bench/results/tmp/affinity; mkdir -p "$TMP"
rm -f "$TMP/hold"; mkfifo "$TMP/hold"; exec 9<> "$TMP/hold"
KIDS=()
cleanup() {
  for k in "${KIDS[@]}"; do kill "$k" 2>/dev/null; done
  wait 2>/dev/null
}
trap cleanup EXIT
start() { # PORT OPTIONS
  # Its standard input is a FIFO this script holds open (fd 9): the server
  # exits at end of file, when this script does, whatever ends it.
  (cd "$HERE" && BENCH_GALLOP_OPTIONS="$2" exec scripts/lisp.sh --load bench/server.lisp \
     --end-toplevel-options native "$1" 0 < "$TMP/hold" > "$TMP/$1.out" 2> "$TMP/$1.err") &
  KIDS+=($!)
}
start 18951 "()"
start 18952 "(:max-thread-count 1 :standby-thread-count 1)"
start 18953 "(:max-thread-count 1 :standby-thread-count 1)"
declare -A PID
for port in 18951 18952 18953; do
  PID[$port]=$(ready_pid "$TMP/$port.out")
  [ -n "${PID[$port]}" ] || { echo "affinity.sh: server on $port did not start (see $TMP/$port.err)" >&2; exit 1; }
done
requests() { awk '/requests in/{print $1}' "$1"; }
half=$((CONNS / 2))
wrk -t2 -c$CONNS -d1s http://127.0.0.1:18951/yo > /dev/null
wrk -t1 -c$half -d1s http://127.0.0.1:18952/yo > /dev/null
wrk -t1 -c$half -d1s http://127.0.0.1:18953/yo > /dev/null
hz=$(getconf CLK_TCK)
report() { # NAME REQUESTS TICKS
  awk -v n="$1" -v r="$2" -v t="$3" -v d="$DUR" -v hz="$hz" \
    'BEGIN { printf "%-5s %9.0f req/s %6.2f us/req\n", n, r / d, t * 1e6 / hz / r }'
}
: > "$TMP/runs"
for r in $(seq "$REPS"); do
  T0=$(cpu_ticks ${PID[18951]})
  wrk -t2 -c$CONNS -d${DUR}s http://127.0.0.1:18951/yo > "$TMP/one.txt"
  T1=$(cpu_ticks ${PID[18951]})
  report one "$(requests "$TMP/one.txt")" $((T1 - T0)) | tee -a "$TMP/runs"
  T0=$(cpu_ticks ${PID[18952]} ${PID[18953]})
  wrk -t1 -c$half -d${DUR}s http://127.0.0.1:18952/yo > "$TMP/split1.txt" &
  W=$!
  wrk -t1 -c$half -d${DUR}s http://127.0.0.1:18953/yo > "$TMP/split2.txt"
  wait $W
  T1=$(cpu_ticks ${PID[18952]} ${PID[18953]})
  report split $(( $(requests "$TMP/split1.txt") + $(requests "$TMP/split2.txt") )) $((T1 - T0)) \
    | tee -a "$TMP/runs"
done
median() { # NAME FIELD: the median of FIELD over NAME's rounds
  awk -v n="$1" -v f="$2" '$1 == n { print $f }' "$TMP/runs" | sort -g \
    | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}
for n in one split; do
  printf "median %-5s %9s req/s %6s us/req\n" $n "$(median $n 2)" "$(median $n 4)"
done
