# nginx-yo.sh -- sourced by the bench scripts that compare with nginx
# (layers.sh, quota-ab.sh, epoll-sets.sh, switches.sh, checkouts-ab.sh,
# at-rest.sh): nginx answering /yo as the Lisp servers do.
#
#   nginx_yo_conf DIR PORT [WORKERS]   writes DIR/nginx.conf (pid, logs and
#                                      temporary directories under DIR) for
#                                      127.0.0.1:PORT, with WORKERS worker
#                                      processes (default 1)
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
