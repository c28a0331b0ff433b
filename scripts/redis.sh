#!/usr/bin/env bash
# A local redis-server on 127.0.0.1 for development and tests: the work queues and leases.
#
#   scripts/redis.sh up        start it (installs Debian's redis-server first if missing), wait for PING
#   scripts/redis.sh down      stop it and forget its port
#   scripts/redis.sh stop      stop it, keep the port (`start` or `up` brings it back on the same port)
#   scripts/redis.sh start     start the stopped server again on the same port
#   scripts/redis.sh restart   stop + start: the server comes back EMPTY (no persistence), which is
#                              what "Redis lost everything" tests want
#   scripts/redis.sh status    exit 0 when running and answering PING
#   scripts/redis.sh env       print TW_REDIS_URL=redis://127.0.0.1:PORT/0 (and, when it also
#                              listens on TW_LISTEN_HOST, TW_REDIS_EXTERNAL_URL=redis://HOST:PORT/0)
#
# No persistence: Redis is a transport in timerwheel, never a store (ARCHITECTURE.md, section 4).
# State lives in .run/redis/ (port, pid, log); .run/redis.env holds the URL. The port is chosen
# free at the first start. `up` on a running, healthy server does nothing.
#
# Environment: TW_REDIS_START_TIMEOUT (s, default 30), TW_REDIS_INSTANCE (a second, independent
# server: state in .run/redis-<instance>/, URL in .run/redis-<instance>.env), TW_REDIS_TLS
# (true|false, default false; read when the instance is first made): the server then listens
# on TLS only (certificate signed by a CA made locally with openssl) and requires a password;
# .env holds TW_REDIS_URL=rediss://..., TW_REDIS_PASSWORD_FILE and TW_REDIS_SSL_CAFILE.
# E.g. TW_REDIS_INSTANCE=secure TW_REDIS_TLS=true scripts/redis.sh up (what the tests run).
# TW_LISTEN_HOST=<an address of this machine> (e.g. the node address `scripts/k8s.sh env` prints)
# makes it listen on that address too, on the same port, for pods of the local cluster; a running
# server is rebound live (CONFIG SET bind: no restart, no data lost). It stays until `down`.
set -euo pipefail

NAME=redis${TW_REDIS_INSTANCE:+-$TW_REDIS_INSTANCE}
[[ "${TW_REDIS_INSTANCE:-}" =~ ^[a-z0-9-]*$ ]] || { echo "redis.sh: TW_REDIS_INSTANCE must be [a-z0-9-]*, got '$TW_REDIS_INSTANCE'" >&2; exit 1; }
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

START_TIMEOUT="${TW_REDIS_START_TIMEOUT:-30}"
TLS="${TW_REDIS_TLS:-false}"
[[ "$TLS" == true || "$TLS" == false ]] || die "TW_REDIS_TLS must be true or false, got '$TLS'"

# TLS and a password (TW_REDIS_TLS=true at the first start): made once, kept in STATE/tls.
make_tls_state() {
    make_tls "$STATE/tls"
    make_password "$STATE/tls/redis.password"
    (umask 077; echo "requirepass $(cat "$STATE/tls/redis.password")" >"$STATE/tls/auth.conf")
}

# The server's options for TLS (empty without): its config file (the password) comes first.
tls_conf() { [[ -d "$STATE/tls" ]] && echo "$STATE/tls/auth.conf"; return 0; }
tls_args() {
    [[ -d "$STATE/tls" ]] || return 0
    printf '%s\n' --port 0 --tls-port "$(port)" --tls-cert-file "$STATE/tls/server.pem" \
        --tls-key-file "$STATE/tls/server.key" --tls-ca-cert-file "$STATE/tls/ca.pem" --tls-auth-clients no
}

# With TLS, .env names rediss:// and the password and CA files.
tls_env() {
    [[ -d "$STATE/tls" ]] || return 0
    sed -i 's|^TW_REDIS_URL=redis://|TW_REDIS_URL=rediss://|' "$ENV_FILE"
    echo "TW_REDIS_PASSWORD_FILE=$STATE/tls/redis.password" >>"$ENV_FILE"
    echo "TW_REDIS_SSL_CAFILE=$STATE/tls/ca.pem" >>"$ENV_FILE"
}

server_bin() {
    command -v redis-server 2>/dev/null || { [[ -x /usr/bin/redis-server ]] && echo /usr/bin/redis-server; }
}

need_server() {
    [[ -n "$(server_bin)" ]] && return 0
    [[ $(id -u) == 0 ]] || die "redis-server is missing: install it (apt-get install redis-server)"
    apt_install redis-server
    [[ -n "$(server_bin)" ]] || die "apt-get installed redis-server but no redis-server binary was found"
}

# Only our server: a redis-server on our port (redis rewrites its argv to "host:port").
running_pid() { pid_matching "redis-server.*127.0.0.1:$(port)"; }

# PING over a raw socket: needs neither redis-cli nor redis-py (with TLS: AUTH, then PING).
healthy() {
    [[ -d "$STATE/tls" ]] && { healthy_tls; return; }
    "$PYTHON" - "$(port)" <<'EOF' >/dev/null 2>&1
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1) as s:
    s.sendall(b"PING\r\n")
    sys.exit(0 if s.recv(64).startswith(b"+PONG") else 1)
EOF
}

healthy_tls() {
    "$PYTHON" - "$(port)" "$STATE/tls/ca.pem" "$STATE/tls/redis.password" <<'EOF' >/dev/null 2>&1
import socket, ssl, sys
ctx = ssl.create_default_context(cafile=sys.argv[2])
password = open(sys.argv[3]).read().strip()
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1) as raw:
    with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        s.sendall(f"AUTH {password}\r\nPING\r\n".encode())
        answer = b""
        while b"PONG" not in answer and len(answer) < 64:
            chunk = s.recv(64)
            if not chunk:
                break
            answer += chunk
        sys.exit(0 if answer.startswith(b"+OK") and b"+PONG" in answer else 1)
EOF
}

external_host() { cat "$STATE/external-host" 2>/dev/null; }

write_env() {
    echo "TW_REDIS_URL=redis://127.0.0.1:$(port)/0" >"$ENV_FILE"
    if [[ -n "$(external_host)" ]]; then echo "TW_REDIS_EXTERNAL_URL=redis://$(external_host):$(port)/0" >>"$ENV_FILE"; fi
    tls_env
}

# Send one command (its words) over a raw socket; exit 0 on a +OK reply.
command_ok() {
    "$PYTHON" - "$(port)" "$@" <<'EOF' >/dev/null 2>&1
import socket, sys
words = [w.encode() for w in sys.argv[2:]]
msg = b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words)
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2) as s:
    s.sendall(msg)
    sys.exit(0 if s.recv(64).startswith(b"+OK") else 1)
EOF
}

launch() {
    local pid deadline bind="127.0.0.1" protected=yes conf=() extra=()
    mapfile -t conf < <(tls_conf)
    mapfile -t extra < <(tls_args)
    port_free "$(port)" || die "port $(port) is taken by another process; run 'scripts/redis.sh down' and 'up' to pick a new one"
    if [[ -n "$(external_host)" ]]; then
        port_free_on "$(port)" "$(external_host)" || die "port $(port) on $(external_host) is taken by another process; run 'scripts/redis.sh down' and 'up'"
        # bound to two addresses of this machine only; no password, so protected mode would
        # refuse the pods' connections
        bind="127.0.0.1 $(external_host)"
        protected=no
    fi
    # shellcheck disable=SC2086  # bind holds one or two addresses
    setsid nohup "$(server_bin)" "${conf[@]}" --bind $bind --port "$(port)" --protected-mode $protected \
        --save "" --appendonly no --daemonize no --dir "$STATE" --logfile "$STATE/redis.log" "${extra[@]}" \
        >>"$STATE/stdout.log" 2>&1 </dev/null 9>&- &
    pid=$!
    echo "$pid" >"$PID_FILE"
    deadline=$((SECONDS + START_TIMEOUT))
    until healthy; do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 20 "$STATE/redis.log" "$STATE/stdout.log" >&2 2>/dev/null || true
            rm -f "$PID_FILE"
            die "redis-server exited during start (log in ${STATE#"$ROOT"/}/redis.log)"
        fi
        ((SECONDS < deadline)) || die "redis-server did not answer PING on port $(port) within ${START_TIMEOUT}s"
        sleep 0.1
    done
    write_env
    log "redis up on 127.0.0.1:$(port)$([[ -n "$(external_host)" ]] && echo " and $(external_host):$(port)") (pid $pid)"
}


cmd_up() {
    local i host
    host="$(listen_host)"
    if [[ -n "$host" && "$host" != "$(external_host)" ]]; then
        mkdir -p "$STATE"
        if [[ -f "$STATE/port" ]] && running_pid >/dev/null && healthy; then
            port_free_on "$(port)" "$host" || die "port $(port) on $host is taken by another process"
            command_ok CONFIG SET bind "127.0.0.1 $host" || die "redis-server did not accept CONFIG SET bind '127.0.0.1 $host'"
            command_ok CONFIG SET protected-mode no || die "redis-server did not accept CONFIG SET protected-mode no"
            log "now also listening on $host:$(port) (TW_LISTEN_HOST)"
        fi
        echo "$host" >"$STATE/external-host"
    fi
    if [[ -f "$STATE/port" ]] && running_pid >/dev/null; then
        for ((i = 0; i < 50; i++)); do # a busy server gets 5 s to answer before it is replaced
            if healthy; then
                write_env
                return 0
            fi
            sleep 0.1
        done
        log "redis-server (pid $(cat "$PID_FILE")) does not answer PING: restarting it"
    fi
    need_server
    [[ -f "$STATE/port" ]] && stop_running 10
    if [[ -f "$STATE/port" ]] && ! port_free "$(port)"; then
        log "the port of the stopped server is taken by another process: choosing a new one"
        rm -f "$STATE/port"
    fi
    if [[ ! -f "$STATE/port" ]]; then
        mkdir -p "$STATE"
        free_port >"$STATE/port"
        [[ "$TLS" == true ]] && make_tls_state
    fi
    launch
}

main() {
    local verb="${1:-}"
    mkdir -p "$RUN"
    case "$verb" in
    env)
        [[ -f "$ENV_FILE" ]] || die "no server started: run 'scripts/redis.sh up'"
        cat "$ENV_FILE"
        return 0
        ;;
    status)
        [[ -f "$STATE/port" ]] && running_pid >/dev/null && healthy && { echo "running on 127.0.0.1:$(port)"; return 0; }
        echo "not running"
        return 1
        ;;
    up | down | start | stop | restart) ;;
    *) die "usage: scripts/redis.sh up|down|start|stop|restart|status|env" ;;
    esac
    exec 9>"$RUN/$NAME.lock"
    flock 9
    case "$verb" in
    up) cmd_up ;;
    down)
        [[ -f "$STATE/port" ]] && stop_running 10
        rm -rf "$STATE" "$ENV_FILE"
        ;;
    start)
        [[ -f "$STATE/port" ]] || die "no stopped server in ${STATE#"$ROOT"/}: use 'up'"
        cmd_up
        ;;
    stop) [[ -f "$STATE/port" ]] && stop_running 10 ;;
    restart)
        [[ -f "$STATE/port" ]] || die "no server to restart: use 'up'"
        stop_running 10
        cmd_up
        ;;
    esac
    return 0
}

main "$@"
