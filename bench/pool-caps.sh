#!/bin/bash
# pool-caps.sh -- one checkout's server with its pool as it adapts and with
# fixed caps, side by side, interleaved: what the pool's size does to
# throughput, latency and the CPU of the server and of its load generator.
#
#   [DURATION=4] [REPS=6] [CONNS_LIST="100 400"] [SLEEP_MS=1] [KIND=native] \
#     bench/pool-caps.sh CAP...
#
# One bench/server.lisp server of KIND (native: gallop:start; gallop: the
# easy-acceptor; gallop-tm) for each CAP, from this checkout: CAP 0 is the
# default pool, any other number is `:max-thread-count CAP` (through
# BENCH_GALLOP_OPTIONS).  Nothing is pinned (`wrk -t2`, the shared setup).
# Each round runs `wrk --latency` with -cN -dDURATION against each server in
# turn, the order reversed every other round.  One line per run: req/s,
# p50 and p99 latency, the server's CPU µs per request (utime + stime from
# /proc over the run) and wrk's own (from /proc, over the middle of its
# run); then, per connection count and cap, the medians over the rounds.
# Ports 19031 on.  Needs wrk (scripts/deps.sh wrk).
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 1 ] || { sed -n '6,7p' "$0" >&2; exit 2; }
CAPS=("$@")
DUR=${DURATION:-4}; REPS=${REPS:-6}; CONNS_LIST=${CONNS_LIST:-"100 400"}
SL=${SLEEP_MS:-1}; KIND=${KIND:-native}
TMP=$HERE/bench/results/tmp/pool-caps; mkdir -p "$TMP"
. "$HERE/bench/lib.sh"
KIDS=()
trap 'for k in "${KIDS[@]}"; do kill "$k" 2>/dev/null; done' EXIT
PORTS=(); PIDS=()
for i in "${!CAPS[@]}"; do
  port=$((19031 + i)); PORTS+=("$port")
  options=""; [ "${CAPS[$i]}" = 0 ] || options="(:max-thread-count ${CAPS[$i]})"
  start_server "$i" "$HERE" "$KIND" "$port" "$SL" env BENCH_GALLOP_OPTIONS="$options"
done
await_servers "${#CAPS[@]}" pool-caps.sh
echo "$(git -C "$HERE" rev-parse --short HEAD) KIND=$KIND SLEEP_MS=$SL: wrk -t2 -cN -d${DUR}s --latency, caps ${CAPS[*]}"
hz=$(getconf CLK_TCK)
for port in "${PORTS[@]}"; do wrk -t2 -c100 -d2s "http://127.0.0.1:$port/yo" > /dev/null; done
: > "$TMP/lines"
for r in $(seq "$REPS"); do
  for c in $CONNS_LIST; do
    order=("${!CAPS[@]}")
    [ $((r % 2)) = 0 ] && order=($(printf '%s\n' "${order[@]}" | tac))
    for i in "${order[@]}"; do
      t0=$(cpu_ticks "${PIDS[$i]}")
      wrk -t2 -c"$c" -d"${DUR}s" --latency "http://127.0.0.1:${PORTS[$i]}/yo" > "$TMP/wrk.txt" & w=$!
      # wrk's own CPU over the middle of its run (its first and last moments
      # connect and print).
      sleep 0.3; w0=$(cpu_ticks "$w"); sleep "$(awk -v d="$DUR" 'BEGIN { print d - 0.6 }')"; w1=$(cpu_ticks "$w")
      wait "$w"
      t1=$(cpu_ticks "${PIDS[$i]}")
      awk -v cap="${CAPS[$i]}" -v c="$c" -v t=$((t1 - t0)) -v wt=$((w1 - w0)) -v hz="$hz" -v d="$DUR" '
        function ms(s) { if (s ~ /us$/) return s / 1000; if (s ~ /ms$/) return s + 0; return s * 1000 }
        / 50%/ { p50 = ms($2) } / 99%/ { p99 = ms($2) }
        /requests in/ { n = $1 } /Requests\/sec/ { rps = $2 }
        END { printf "c%-4s cap %-4s %8.0f req/s  p50 %6.2f ms  p99 %7.2f ms  server %6.1f us/req  wrk %5.1f us/req\n",
                     c, cap, rps, p50, p99, t * 1e6 / hz / n, wt * 1e6 / hz / (rps * (d - 0.6)) }' "$TMP/wrk.txt" \
        | tee -a "$TMP/lines"
    done
  done
done
echo "medians over $REPS rounds:"
sort -k1,1 -k3,3n "$TMP/lines" | awk '
  function median(a, n,   i, j, t) { for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
                                     return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
  function flush() { if (k) printf "%s cap %-4s %8.0f req/s  p50 %6.2f ms  p99 %7.2f ms  server %6.1f us/req  wrk %5.1f us/req\n",
                                   key1, key2, median(r, k), median(p, k), median(q, k), median(s, k), median(w, k); k = 0 }
  { if ($1 != key1 || $3 != key2) { flush(); key1 = $1; key2 = $3 }
    k++; r[k] = $4; p[k] = $7; q[k] = $10; s[k] = $13; w[k] = $16 }
  END { flush() }'
