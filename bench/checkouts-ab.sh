#!/bin/bash
# checkouts-ab.sh -- gallop:start from two checkouts (or one against itself)
# side by side with nginx, in the shared setup, interleaved: what a change
# does to throughput on a machine whose speed moves from run to run.
#
#   [DURATION=3] [REPS=8] [CONNS_LIST="100 400"] [SLEEP_MS=0] [KIND=native] \
#     [SETUP=shared] [HOG=1] [POST_BYTES=N] [CLOSE=1] [ENV_A=..] [ENV_B=..] \
#     bench/checkouts-ab.sh CHECKOUT-A [CHECKOUT-B]
#
# Two bench/server.lisp servers of KIND (native: gallop:start; gallop: the
# easy-acceptor; gallop-tm), A from CHECKOUT-A and B from CHECKOUT-B (default:
# this checkout), and nginx.  SETUP=shared (the default): nothing pinned,
# nginx with a worker per CPU, `wrk -t2`; SETUP=pinned: the servers and
# nginx (one worker) on CPU 0, `wrk -t1` on CPU 1, as `make bench` pins them.
# Each round runs wrk with -cN -dDURATION against the three in turn, the
# order rotated every round and reversed every other.  One line per round: each
# server's req/s and CPU µs per request (utime + stime from /proc over the
# run, nginx's master and workers summed), A ÷ B, A ÷ nginx, B ÷ nginx; then
# the medians of those per-round ratios, for each connection count.  Give
# the same checkout twice for an A/A run: how far two identical servers
# drift apart here is the least difference one such run can show
# (doc/design.md, "A/A runs set the noise floor").  HOG=1: a busy loop on
# the last CPU for the whole run, as in `make bench`'s -hog scenarios (in
# the shared setup only).  POST_BYTES=N: every request POSTs an N-octet
# form body (a=b&a=b...), keep-alive, to the servers' /upload (which reads
# it) and to nginx's /yo (which discards it).  CLOSE=1: every request asks
# Connection: close (a connection per request, as make bench's close rows).
# ENV_A, ENV_B: VAR=VALUE words set in the environment of server A or B
# only (bench/server.lisp's settings), to compare one checkout with itself
# under two settings.  Ports 19001-19003.  Needs wrk and nginx
# (scripts/deps.sh wrk nginx-light).
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 1 ] || { sed -n '6,7p' "$0" >&2; exit 2; }
A=$(cd "$1" && pwd); B=$(cd "${2:-$HERE}" && pwd)
DUR=${DURATION:-3}; REPS=${REPS:-8}; CONNS_LIST=${CONNS_LIST:-"100 400"}
SL=${SLEEP_MS:-0}; KIND=${KIND:-native}
case ${SETUP:-shared} in
  shared) PIN=(); WRK=(wrk -t2); NGINX_WORKERS=$(nproc) ;;
  pinned) PIN=(taskset -c 0); WRK=(taskset -c 1 wrk -t1); NGINX_WORKERS=1 ;;
  *) echo "checkouts-ab.sh: SETUP is shared or pinned" >&2; exit 2 ;;
esac
TMP=$HERE/bench/results/tmp/checkouts-ab; mkdir -p "$TMP"
KIDS=()
cleanup() { for k in "${KIDS[@]}"; do kill "$k" 2>/dev/null; done
            [ -f "$TMP/nginx/nginx.pid" ] && kill "$(cat "$TMP/nginx/nginx.pid")" 2>/dev/null; }
trap cleanup EXIT
if [ "${HOG:-0}" = 1 ]; then
  [ "${SETUP:-shared}" = shared ] || { echo "checkouts-ab.sh: HOG=1 needs SETUP=shared" >&2; exit 2; }
  taskset -c $(( $(nproc) - 1 )) sh -c 'while :; do :; done' & KIDS+=($!)
fi
PORTS=(19001 19002 19003); NAMES=(A B nginx)
. "$HERE/bench/lib.sh"
ENVS=("${ENV_A:-}" "${ENV_B:-}")
CHECKOUTS=("$A" "$B")
for i in 0 1; do
  # shellcheck disable=SC2086 # ENV_A and ENV_B are words
  start_server "$i" "${CHECKOUTS[$i]}" "$KIND" "${PORTS[$i]}" "$SL" env ${ENVS[$i]} "${PIN[@]}"
done
nginx_yo_conf "$TMP/nginx" "${PORTS[2]}" "$NGINX_WORKERS"
"${PIN[@]}" nginx -c "$TMP/nginx/nginx.conf" -e "$TMP/nginx/error.log" || exit 1
PIDS=()
await_servers 2 checkouts-ab.sh
sleep 0.5
MASTER=$(cat "$TMP/nginx/nginx.pid")
PIDS+=("$MASTER,$(pgrep -P "$MASTER" | paste -sd,)")
echo "A: $A ($(git -C "$A" rev-parse --short HEAD 2>/dev/null))"
echo "B: $B ($(git -C "$B" rev-parse --short HEAD 2>/dev/null))"
[ -z "${ENV_A:-}${ENV_B:-}" ] || echo "ENV_A: ${ENV_A:-}  ENV_B: ${ENV_B:-}"
echo "KIND=$KIND SLEEP_MS=$SL SETUP=${SETUP:-shared} HOG=${HOG:-0}: ${WRK[*]} -cN -d${DUR}s"
hz=$(getconf CLK_TCK)
PATHS=(/yo /yo /yo); WRK_S=()
if [ "${POST_BYTES:-0}" -gt 0 ]; then
  PATHS=(/upload /upload /yo)
  printf 'wrk.method = "POST"\nwrk.body = string.rep("a=b&", %d)\nwrk.headers["Content-Type"] = "application/x-www-form-urlencoded"\n' \
    $(( POST_BYTES / 4 )) > "$TMP/post.lua"
  WRK_S=(-s "$TMP/post.lua")
  echo "POST_BYTES=$POST_BYTES: POST a form to /upload (nginx: /yo)"
fi
if [ "${CLOSE:-0}" = 1 ]; then
  WRK_S+=(-H "Connection: close")
  echo "CLOSE=1: every request asks Connection: close"
fi
for i in 0 1 2; do "${WRK[@]}" -c400 -d1s "http://127.0.0.1:${PORTS[$i]}/yo" > /dev/null; done
for c in $CONNS_LIST; do
  : > "$TMP/ratios-$c"
  for r in $(seq "$REPS"); do
    RPS=(); US=()
    for k in 0 1 2; do
      if [ $((r % 2)) = 0 ]; then i=$(( (2 - k + r) % 3 )); else i=$(( (k + r) % 3 )); fi
      t0=$(cpu_ticks "${PIDS[$i]}")
      "${WRK[@]}" "${WRK_S[@]}" -c"$c" -d"${DUR}s" "http://127.0.0.1:${PORTS[$i]}${PATHS[$i]}" > "$TMP/wrk.txt"
      t1=$(cpu_ticks "${PIDS[$i]}")
      RPS[$i]=$(awk -v d="$DUR" '/requests in/ { print $1 / d }' "$TMP/wrk.txt")
      US[$i]=$(awk -v t=$((t1 - t0)) -v hz="$hz" '/requests in/ { printf "%.2f", t * 1e6 / hz / $1 }' "$TMP/wrk.txt")
      [ -n "${RPS[$i]}" ] || { echo "checkouts-ab.sh: wrk gave no result for ${NAMES[$i]}" >&2; cat "$TMP/wrk.txt" >&2; exit 1; }
    done
    awk -v r="$r" -v c="$c" -v a="${RPS[0]}" -v b="${RPS[1]}" -v n="${RPS[2]}" \
        -v ua="${US[0]}" -v ub="${US[1]}" -v un="${US[2]}" 'BEGIN {
          printf "c%-4s round %2d  A %7.0f req/s %6.2f us/req  B %7.0f %6.2f  nginx %7.0f %6.2f  A/B %.2f  A/nginx %.2f  B/nginx %.2f\n",
                 c, r, a, ua, b, ub, n, un, a / b, a / n, b / n }'
    awk -v a="${RPS[0]}" -v b="${RPS[1]}" -v n="${RPS[2]}" 'BEGIN { print a / b, a / n, b / n }' >> "$TMP/ratios-$c"
  done
  for col in 1 2 3; do
    label=$(echo "A/B A/nginx B/nginx" | cut -d' ' -f$col)
    printf "c%-4s median %-8s %s\n" "$c" "$label" \
      "$(cut -d' ' -f$col "$TMP/ratios-$c" | sort -g | awk '{ v[NR] = $1 } END { printf "%.3f", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')"
  done
done
