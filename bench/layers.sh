#!/bin/bash
# layers.sh -- what each layer of the native path costs per request.
#
#   [DURATION=3] [REPS=3] bench/layers.sh [LAYERS...]
#
# Starts one bench/layers-server.lisp per LAYERS (default: floor table env
# respond native; see that file) and nginx with one worker, all pinned to
# core 0, and runs `wrk -t1 -c100 -dDURATION` (keep-alive, GET /yo) on core 1
# against each in turn, REPS rounds, interleaved.  Prints for every run the
# req/s and the server's user, system and total CPU microseconds per request
# (/proc/PID/stat over the run), then each one's median total.  A layer's
# cost is the difference between two servers' totals in the same run (env -
# floor: the Clack environment; table - floor: its :HEADERS table alone).
# A server that costs more also pays more in the kernel: wrk waits for it
# more often, so its sends wake wrk more often (doc/design.md, "The :headers
# table is a fresh hash table").  Ports
# 18931.. and 18930 (nginx).  Needs wrk and nginx (scripts/deps.sh wrk nginx-light).
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
DUR=${DURATION:-3}; REPS=${REPS:-3}
LAYERS=("$@"); [ ${#LAYERS[@]} -eq 0 ] && LAYERS=(floor table env respond native)
TMP=$HERE/bench/results/tmp/layers; mkdir -p "$TMP"
. "$HERE/bench/nginx-yo.sh"
. "$HERE/bench/lib.sh"
nginx_yo_conf "$TMP" 18930
declare -A PORT PID
SERVERS=()
rm -f "$TMP/hold"; mkfifo "$TMP/hold"; exec 9<> "$TMP/hold"
cleanup() {
  for s in "${SERVERS[@]}"; do kill "$s" 2>/dev/null; done
  [ -f "$TMP/nginx.pid" ] && kill "$(cat "$TMP/nginx.pid")" 2>/dev/null
  wait 2>/dev/null
}
trap cleanup EXIT
port=18930
for layers in "${LAYERS[@]}"; do
  port=$((port+1)); PORT[$layers]=$port
  # Its standard input is a FIFO this script holds open (fd 9): the server
  # exits at end of file, when this script does, whatever ends it.
  (cd "$HERE" && exec taskset -c 0 scripts/lisp.sh --load bench/layers-server.lisp \
     --end-toplevel-options $port $layers < "$TMP/hold" > "$TMP/$layers.out" 2> "$TMP/$layers.err") &
  SERVERS+=($!)
done
taskset -c 0 nginx -c "$TMP/nginx.conf" -g 'daemon off;' 2>> "$TMP/error.log" &
for layers in "${LAYERS[@]}"; do
  PID[$layers]=$(ready_pid "$TMP/$layers.out")
  [ -n "${PID[$layers]}" ] || { echo "layers.sh: $layers did not start (see $TMP/$layers.err)" >&2; exit 1; }
done
sleep 1
PORT[nginx]=18930; PID[nginx]=$(pgrep -P "$(cat "$TMP/nginx.pid")" | head -1)
[ -n "${PID[nginx]}" ] || { echo "layers.sh: nginx did not start" >&2; exit 1; }
NAMES=("${LAYERS[@]}" nginx)
for n in "${NAMES[@]}"; do taskset -c 1 wrk -t1 -c100 -d1s http://127.0.0.1:${PORT[$n]}/yo > /dev/null; done
: > "$TMP/runs"
for r in $(seq "$REPS"); do
  for n in "${NAMES[@]}"; do
    T0=$(cpu_user_system ${PID[$n]})
    N=$(taskset -c 1 wrk -t1 -c100 -d${DUR}s http://127.0.0.1:${PORT[$n]}/yo | awk '/requests in/{print $1}')
    T1=$(cpu_user_system ${PID[$n]})
    echo "$n $N $T0 $T1" | awk -v d=$DUR -v hz=$(getconf CLK_TCK) '{
      u = ($5-$3)*1e6/hz/$2; s = ($6-$4)*1e6/hz/$2
      printf "%-8s req/s %7d  us/req user %5.2f sys %5.2f total %5.2f\n", $1, $2/d, u, s, u+s }' | tee -a "$TMP/runs"
  done
done
echo "median total us/req:"
for n in "${NAMES[@]}"; do
  awk -v n=$n '$1 == n {print $NF}' "$TMP/runs" | sort -n | awk -v n=$n '{v[NR]=$1} END {printf "  %-8s %5.2f\n", n, v[int((NR+1)/2)]}'
done
