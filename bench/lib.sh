# lib.sh -- sourced by the bench shell scripts (checkouts-ab.sh,
# pool-caps.sh): the steps they share.  The caller sets TMP (a directory of
# its own) and the arrays KIDS and PIDS.
#
#   start_server I CHECKOUT KIND PORT SLEEP_MS [PREFIX...]
#                          starts CHECKOUT's bench/server.lisp (KIND PORT
#                          SLEEP_MS) in the background under the command
#                          words PREFIX (env VAR=VALUE..., taskset ...), its
#                          output in $TMP/serverI.out and .err, and as its
#                          standard input a FIFO this shell holds open, so
#                          that the server exits with the script; adds the
#                          background job to KIDS
#   await_servers N NAME   waits for servers 0 to N-1 (start_server) to
#                          listen and adds their pids to PIDS; on one that
#                          never does, says so as NAME and exits
#   ready_pid FILE         waits (up to 120 s) for the line "READY <pid>" that
#                          bench/server.lisp prints once it listens, in FILE
#                          (its standard output); prints the pid, or nothing
#                          if it never came
#   cpu_ticks PIDS...      the clock ticks (utime + stime, /proc/PID/stat
#                          fields 14 and 15, every thread) of the processes
#                          PIDS, summed; each argument is a pid or a
#                          comma-separated list of them (nginx's master and
#                          workers)
#   nginx_yo_conf DIR PORT [WORKERS]
#                          writes DIR/nginx.conf (pid, logs and temporary
#                          directories under DIR) for 127.0.0.1:PORT, with
#                          WORKERS worker processes (default 1), answering
#                          /yo as the Lisp servers do
start_server() {
  local i=$1 checkout=$2 kind=$3 port=$4 sleep_ms=$5 fd
  shift 5
  rm -f "$TMP/hold$i"; mkfifo "$TMP/hold$i"; exec {fd}<> "$TMP/hold$i"
  (cd "$checkout" && exec "$@" scripts/lisp.sh --load bench/server.lisp \
     --end-toplevel-options "$kind" "$port" "$sleep_ms" < "$TMP/hold$i" > "$TMP/server$i.out" 2> "$TMP/server$i.err") &
  KIDS+=($!)
}
await_servers() {
  local i pid
  for i in $(seq 0 $(($1 - 1))); do
    pid=$(ready_pid "$TMP/server$i.out")
    [ -n "$pid" ] || { echo "$2: server $i did not start (see $TMP/server$i.err)" >&2; exit 1; }
    PIDS+=("$pid")
  done
}
ready_pid() {
  local i
  for i in $(seq 240); do grep -q READY "$1" 2>/dev/null && break; sleep 0.5; done
  awk '/READY/{print $2; exit}' "$1" 2>/dev/null
}
cpu_ticks() {
  local t=0 p pu ps
  for p in ${*//,/ }; do
    read -r pu ps < <(awk '{print $14, $15}' "/proc/$p/stat")
    t=$((t + pu + ps))
  done
  echo "$t"
}
nginx_yo_conf() {
  local dir=$1 port=$2 workers=${3:-1}
  mkdir -p "$dir"/{body,proxy,fastcgi,uwsgi,scgi}
  cat > "$dir/nginx.conf" <<CONF
worker_processes $workers;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 4096; }
http {
    access_log off; keepalive_timeout 75s; keepalive_requests 1000000;
    client_body_temp_path $dir/body; proxy_temp_path $dir/proxy; fastcgi_temp_path $dir/fastcgi;
    uwsgi_temp_path $dir/uwsgi; scgi_temp_path $dir/scgi;
    server { listen 127.0.0.1:$port; location = /yo { default_type text/plain; return 200 "Hey!"; } }
}
CONF
}
