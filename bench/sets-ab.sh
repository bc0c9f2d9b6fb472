#!/bin/bash
# sets-ab.sh -- one epoll set against one per CPU, for several front ends at
# once, without nginx: the A/B behind doc/design.md, "An epoll set per
# CPU".
#
#   [DURATION=3] [REPS=8] [SLEEP_MS=1] [KINDS="gallop gallop-tm"] [CONNS_LIST="100 400"] bench/sets-ab.sh
#
# For each KIND (bench/server.lisp's: gallop, gallop-tm, native) two
# servers side by side, nothing pinned: GALLOP_EPOLL_SETS=1 (one set for all
# workers) and GALLOP_EPOLL_SETS=cpus (the default), their handlers sleeping
# SLEEP_MS.  Each round runs `wrk -t2 -cN -dDURATION` against every server in
# turn, in the reverse order every other round; one line per run: round,
# connections, KIND/SETS, req/s, server CPU µs per request (utime + stime
# from /proc over the run), and the server's thread count after it.  Then,
# per KIND, the medians of the per-round ratios.  Ports 18991 and up.
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
. "$HERE/bench/lib.sh"
DUR=${DURATION:-3}; REPS=${REPS:-8}; SL=${SLEEP_MS:-1}
KINDS=${KINDS:-"gallop gallop-tm"}; CONNS_LIST=${CONNS_LIST:-"100 400"}
TMP=$HERE/bench/results/tmp/sets-ab; mkdir -p "$TMP"
rm -f "$TMP/hold"; mkfifo "$TMP/hold"; exec 9<> "$TMP/hold"
KIDS=()
cleanup() { for k in "${KIDS[@]}"; do kill "$k" 2>/dev/null; done; }
trap cleanup EXIT
(cd "$HERE" && scripts/lisp.sh --eval '(asdf:load-system "gallop")' \
   --eval '(asdf:load-system "gallop/native")' > /dev/null 2>&1) \
  || { echo "sets-ab.sh: Gallop does not compile" >&2; exit 1; }
declare -A PID NAME
PORTS=(); port=18990
for kind in $KINDS; do
  for sets in 1 cpus; do
    port=$((port + 1)); PORTS+=("$port"); NAME[$port]="$kind/$sets"
    # Standard input is a FIFO this script holds: the server exits with it.
    (cd "$HERE" && exec env GALLOP_EPOLL_SETS="$sets" scripts/lisp.sh --load bench/server.lisp \
       --end-toplevel-options "$kind" "$port" "$SL" < "$TMP/hold" > "$TMP/$port.out" 2> "$TMP/$port.err") &
    KIDS+=($!)
  done
done
for port in "${PORTS[@]}"; do
  PID[$port]=$(ready_pid "$TMP/$port.out")
  [ -n "${PID[$port]}" ] || { echo "sets-ab.sh: server on $port did not start (see $TMP/$port.err)" >&2; exit 1; }
done
hz=$(getconf CLK_TCK)
for port in "${PORTS[@]}"; do wrk -t2 -c400 -d1s "http://127.0.0.1:$port/yo" > /dev/null; done
: > "$TMP/runs"
for r in $(seq "$REPS"); do
  ORDER="${PORTS[*]}"
  [ $((r % 2)) = 0 ] && ORDER=$(printf '%s\n' "${PORTS[@]}" | tac | tr '\n' ' ')
  for c in $CONNS_LIST; do
    for port in $ORDER; do
      t0=$(cpu_ticks "${PID[$port]}")
      wrk -t2 -c"$c" -d"${DUR}s" "http://127.0.0.1:$port/yo" > "$TMP/wrk.txt"
      t1=$(cpu_ticks "${PID[$port]}")
      threads=$(ls "/proc/${PID[$port]}/task" | wc -l)
      awk -v n="${NAME[$port]}" -v r="$r" -v c="$c" -v t="$((t1 - t0))" -v d="$DUR" -v hz="$hz" -v th="$threads" \
        '/requests in/ { printf "%d c%s %s %.0f %.2f %d\n", r, c, n, $1 / d, t * 1e6 / hz / $1, th }' \
        "$TMP/wrk.txt" | tee -a "$TMP/runs"
    done
  done
done
# Per KIND: sets per CPU ÷ one set (req/s, CPU per request) at each count,
# and each pool's rate at the last count ÷ the first.
awk -v conns="$CONNS_LIST" '
  function median(a, n,   i, j, t) {
    for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] > a[j]; j--) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
  { split($3, ks, "/"); rate[$1, $2, ks[1], ks[2]] = $4; cpu[$1, $2, ks[1], ks[2]] = $5
    kinds[ks[1]] = 1; if ($1 > R) R = $1 }
  END {
    nc = split(conns, cs, " ")
    for (k in kinds) {
      for (i = 1; i <= nc; i++) {
        c = "c" cs[i]
        for (r = 1; r <= R; r++) { x[r] = rate[r, c, k, "cpus"] / rate[r, c, k, "1"]; y[r] = cpu[r, c, k, "cpus"] / cpu[r, c, k, "1"] }
        printf "%s %s median of %d rounds: req/s sets per CPU / one set %.3f, CPU/req %.3f\n", k, c, R, median(x, R), median(y, R)
      }
      first = "c" cs[1]; last = "c" cs[nc]
      for (r = 1; r <= R; r++) { x[r] = rate[r, last, k, "1"] / rate[r, first, k, "1"]; y[r] = rate[r, last, k, "cpus"] / rate[r, first, k, "cpus"] }
      printf "%s %s / %s median: one set %.3f, sets per CPU %.3f\n", k, last, first, median(x, R), median(y, R)
    }
  }' "$TMP/runs"
