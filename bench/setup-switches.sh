#!/bin/bash
# setup-switches.sh -- what sharing the CPUs with wrk does to each front end's
# cost per request: the same server processes measured pinned and shared,
# with their context switches and epoll_wait calls per request.
#
#   [DURATION=4] [REPS=3] [CONNS=10] [KINDS="native gallop"] bench/setup-switches.sh
#
# One bench/server.lisp server (0 ms) of each KIND (native: gallop:start;
# gallop: the easy-acceptor; gallop-tm), started once and moved between the
# setups with `taskset -a -p` (every thread; new ones inherit it): pinned,
# the server on CPU 0 and `taskset -c 1 wrk -t1`; shared, the server on every
# CPU and `wrk -t2`.  Each round runs, for each setup and kind in turn,
# `wrk -cCONNS -dDURATION`, and from 0.5 s into it `perf stat` on the server
# for DURATION - 1 seconds.  One line per run: req/s, the server's CPU µs per
# request (utime + stime from /proc over the wrk run), and per request over
# perf's window: context switches, CPU migrations, epoll_wait calls and
# sendto calls.  Ports 19101 on.  Needs wrk and perf (scripts/deps.sh wrk
# linux-perf).  doc/design.md, "Shared c10 costs every server more".
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
DUR=${DURATION:-4}; REPS=${REPS:-3}; CONNS=${CONNS:-10}
read -r -a KINDS <<< "${KINDS:-native gallop}"
TMP=$HERE/bench/results/tmp/setup-switches; mkdir -p "$TMP"
. "$HERE/bench/lib.sh"
KIDS=()
trap 'for k in "${KIDS[@]}"; do kill "$k" 2>/dev/null; done' EXIT
PIDS=(); PORTS=()
for i in "${!KINDS[@]}"; do
  PORTS+=($((19101 + i)))
  start_server "$i" "" "${KINDS[$i]}" "${PORTS[$i]}" 0
done
await_servers "${#KINDS[@]}" setup-switches.sh
hz=$(getconf CLK_TCK)
EVENTS=context-switches,cpu-migrations,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_sendto
for r in $(seq "$REPS"); do
  for setup in pinned shared; do
    for i in "${!KINDS[@]}"; do
      if [ "$setup" = pinned ]; then
        taskset -a -p -c 0 "${PIDS[$i]}" > /dev/null; WRK=(taskset -c 1 wrk -t1)
      else
        taskset -a -p -c "0-$(($(nproc) - 1))" "${PIDS[$i]}" > /dev/null; WRK=(wrk -t2)
      fi
      t0=$(cpu_ticks "${PIDS[$i]}")
      "${WRK[@]}" -c"$CONNS" -d"${DUR}s" "http://127.0.0.1:${PORTS[$i]}/yo" > "$TMP/wrk.txt" & w=$!
      sleep 0.5
      perf stat -x, -e "$EVENTS" -p "${PIDS[$i]}" -o "$TMP/perf.txt" -- sleep $((DUR - 1)) > /dev/null 2>&1
      wait "$w"
      t1=$(cpu_ticks "${PIDS[$i]}")
      awk -F, -v kind="${KINDS[$i]}" -v setup="$setup" -v d="$DUR" -v t=$((t1 - t0)) -v hz="$hz" \
          -v wrk="$(awk '/requests in/ { print $1 }' "$TMP/wrk.txt")" '
        NF >= 3 && $1 ~ /^[0-9]+$/ { v[$3] = $1 }
        END { rate = wrk / d; window = rate * (d - 1)
              printf "%-7s %-6s %7.0f req/s %6.2f us/req %.3f switches/req %.4f migrations/req %.3f epoll_wait/req %.3f sendto/req\n",
                     kind, setup, rate, t * 1e6 / hz / wrk, v["context-switches"] / window, v["cpu-migrations"] / window,
                     v["syscalls:sys_enter_epoll_wait"] / window, v["syscalls:sys_enter_sendto"] / window }' "$TMP/perf.txt"
    done
  done
done
