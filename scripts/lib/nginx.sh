# nginx.sh - nginx as a plain HTTP hop in front of replicas, the floor the router benchmarks
# judge an L7 router against (scripts/router-latency.sh, scripts/router-paired.sh).

# nginx_conf DIR PORT WORKERS URL...: writes DIR/nginx.conf: WORKERS worker processes
# listening on 127.0.0.1:PORT, round-robin over the replicas at URL... (http://host:port),
# keep-alive both ways (no request limit per connection, as the routers have none), nothing
# buffered, TCP_NODELAY. Start it with `nginx -p DIR -c DIR/nginx.conf -e DIR/error.log`.
nginx_conf() {
  local dir=$1 port=$2 workers=$3 u servers=""
  shift 3
  mkdir -p "$dir/tmp"
  for u in "$@"; do servers+="    server ${u#http://};"$'\n'; done
  cat >"$dir/nginx.conf" <<NGINXEOF
daemon off;
master_process on;
worker_processes $workers;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $dir/tmp/body;
  proxy_temp_path $dir/tmp/proxy;
  fastcgi_temp_path $dir/tmp/fastcgi;
  uwsgi_temp_path $dir/tmp/uwsgi;
  scgi_temp_path $dir/tmp/scgi;
  client_max_body_size 64m;
  client_body_buffer_size 1m;
  keepalive_requests 100000000;
  upstream replicas {
$servers    keepalive 256;
    keepalive_requests 100000000;
  }
  server {
    listen 127.0.0.1:$port;
    location / {
      proxy_pass http://replicas;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      tcp_nodelay on;
    }
  }
}
NGINXEOF
}

# nginx_bin: prints the nginx binary (Debian keeps it in /usr/sbin, which a user's PATH may
# lack); fails, saying how to install it, when there is none.
nginx_bin() {
  PATH=$PATH:/usr/sbin command -v nginx ||
    { echo "nginx is not installed (apt-get install nginx)" >&2; return 1; }
}

# start_nginx DIR WORKERS PREFIX URL...: nginx_conf DIR on a free port, then nginx from it in the
# background (its output in PREFIX.out and PREFIX.err), waited for until it listens. Sets
# NGINX_PID as soon as it is started (empty before: for the caller's cleanup) and NGINX_URL.
# Fails, saying why, when nginx is not installed or does not listen within 30 s. Needs
# lib/net.sh.
start_nginx() {
  local dir=$1 workers=$2 prefix=$3 port bin
  shift 3
  NGINX_PID=
  bin=$(nginx_bin) || return 1
  port=$(free_ports 1)
  nginx_conf "$dir" "$port" "$workers" "$@"
  "$bin" -p "$dir" -c "$dir/nginx.conf" -e "$dir/error.log" >"$prefix.out" 2>"$prefix.err" &
  NGINX_PID=$!
  NGINX_URL=http://127.0.0.1:$port
  wait_port "127.0.0.1:$port" "$NGINX_PID" 30 ||
    { echo "nginx did not listen (see $prefix.err)" >&2; return 1; }
}
