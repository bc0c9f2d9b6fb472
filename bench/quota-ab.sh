#!/bin/bash
# quota-ab.sh -- native path against nginx with the SERVER as the bottleneck.
#
#   [DURATION=5] bench/quota-ab.sh [REPS] [QUOTA%] [BASE-CHECKOUT]     (as root)
#
# Under `make bench` the server has core 0 and wrk core 1; on a fast day wrk
# is the limit (both servers then show about the same req/s and nginx's core
# idles), on a slow one the server is.  Here every server is pinned to core 0
# AND limited to QUOTA% of it (default 50) by its own cgroup (v1 cpu
# controller, or v2 cpu.max), so wrk always has headroom and the req/s ratio
# measures the servers alone.  Each repetition runs wrk -t1 -c100 -dDURATION
# (keep-alive, GET /yo) against: the native server of BASE-CHECKOUT (another
# clone or worktree, when given), this checkout's native server, and nginx,
# one after the other, and prints their req/s and ratios to nginx, then the
# median ratios.  The host's noise comes in bursts of seconds: many short
# repetitions (DURATION=2, 30 of them) give a steadier median than a few long.
# Ports 18193..18195.  Needs wrk and nginx (scripts/deps.sh wrk nginx-light).
set -u
REPS=${1:-4}; QUOTA=${2:-50}; BASE=${3:-}; SECONDS_EACH=${DURATION:-5}
HERE=$(cd "$(dirname "$0")/.." && pwd)
TMP=$HERE/bench/results/tmp/quota-ab; mkdir -p "$TMP"
if [ -f /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then CG=/sys/fs/cgroup/cpu; V=1
elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then CG=/sys/fs/cgroup; V=2; echo +cpu > $CG/cgroup.subtree_control
else echo "no cgroup cpu controller" >&2; exit 1; fi
limit() { # name pid
  mkdir -p $CG/gallop-ab-$1
  if [ $V = 1 ]; then echo 10000 > $CG/gallop-ab-$1/cpu.cfs_period_us; echo $((QUOTA*100)) > $CG/gallop-ab-$1/cpu.cfs_quota_us
  else echo "$((QUOTA*100)) 10000" > $CG/gallop-ab-$1/cpu.max; fi
  echo $2 > $CG/gallop-ab-$1/cgroup.procs
}
. "$HERE/bench/nginx-yo.sh"
. "$HERE/bench/lib.sh"
nginx_yo_conf "$TMP" 18195
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill $p 2>/dev/null; done
  pkill -f "nginx -p $TMP" 2>/dev/null; pkill -x -f "sleep 86399" 2>/dev/null; sleep 0.5
  for g in base new nginx; do rmdir $CG/gallop-ab-$g 2>/dev/null; done
}
trap cleanup EXIT
start_native() { # dir port -> pid
  rm -f "$TMP/out.$2"
  # (its standard input stays open while `sleep` runs: end of file stops it)
  (cd "$1" && sleep 86399 | taskset -c 0 scripts/lisp.sh --load bench/server.lisp \
      --end-toplevel-options native $2 0 > "$TMP/out.$2" 2> "$TMP/err.$2") > /dev/null 2>&1 &
  ready_pid "$TMP/out.$2"
}
taskset -c 0 nginx -p "$TMP" -e "$TMP/error.log" -c "$TMP/nginx.conf" -g 'daemon off;' &
sleep 1; NGINX=$(pgrep -f "nginx: worker" | head -1); limit nginx $NGINX
NEW=$(start_native "$HERE" 18194); PIDS+=($NEW); limit new $NEW
if [ -n "$BASE" ]; then OLD=$(start_native "$BASE" 18193); PIDS+=($OLD); limit base $OLD; fi
rps() { taskset -c 1 wrk -t1 -c100 -d${SECONDS_EACH}s --timeout 2s http://127.0.0.1:$1/yo | awk '/Requests\/sec/{print $2}'; }
for p in 18194 18195 ${BASE:+18193}; do taskset -c 1 wrk -t1 -c10 -d2s http://127.0.0.1:$p/yo > /dev/null; done
sleep 1  # the pool re-reads its CPU quota once a second
echo "servers on CPU 0 limited to ${QUOTA}% of it; wrk -t1 -c100 -d${SECONDS_EACH}s on CPU 1"
RATIOS=$TMP/ratios; : > $RATIOS
for r in $(seq 1 $REPS); do
  old=""; [ -n "$BASE" ] && old=$(rps 18193)
  new=$(rps 18194); ng=$(rps 18195)
  if [ -z "$new" ] || [ -z "$ng" ] || { [ -n "$BASE" ] && [ -z "$old" ]; }; then
    echo "rep $r  skipped: a wrk run printed no rate"; continue
  fi
  if [ -n "$BASE" ]; then
    echo "rep $r  base $old  new $new  nginx $ng  base/nginx $(awk "BEGIN{printf \"%.3f\", $old/$ng}")  new/nginx $(awk "BEGIN{printf \"%.3f\", $new/$ng}")"
    echo "$(awk "BEGIN{print $old/$ng, $new/$ng}")" >> $RATIOS
  else
    echo "rep $r  native $new  nginx $ng  native/nginx $(awk "BEGIN{printf \"%.3f\", $new/$ng}")"
    echo "0 $(awk "BEGIN{print $new/$ng}")" >> $RATIOS
  fi
done
median() { sort -g | awk '{v[NR]=$1} END{printf "%.3f", (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }
[ -n "$BASE" ] && echo "median base/nginx $(awk '{print $1}' $RATIOS | median)"
echo "median $([ -n "$BASE" ] && echo new || echo native)/nginx $(awk '{print $2}' $RATIOS | median)"
