# shellcheck shell=bash
# What the scripts share (kafka, redis, k8s, registry, spark, chromium, helm, prometheus, peers):
# sourced after they set NAME, which names the state and prefixes the messages.
#
# Defines ROOT (the checkout), RUN (.run/), STATE (.run/NAME/), ENV_FILE (.run/NAME.env),
# PID_FILE (.run/NAME/NAME.pid) and PYTHON (the caller's, else .venv/bin/python, else python3),
# and the helpers below. Each server's own steps (install, launch, health check, stop) stay in
# its script.

: "${NAME:?set NAME before sourcing common.sh}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN="$ROOT/.run"
STATE="$RUN/$NAME"
# shellcheck disable=SC2034  # read by the sourcing script
ENV_FILE="$RUN/$NAME.env"
PID_FILE="$STATE/$NAME.pid"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

log() { echo "$NAME.sh: $*" >&2; }
die() { log "$*"; exit 1; }

# The Go toolchain that builds test infrastructure: GO, else `go` on PATH, else /usr/local/go/bin/go.
go_bin() {
    if [[ -n "${GO:-}" ]]; then [[ -x "$GO" ]] && echo "$GO"; return; fi
    command -v go 2>/dev/null && return
    [[ -x /usr/local/go/bin/go ]] && { echo /usr/local/go/bin/go; return; }
    return 1
}

# build_lock WHAT: hold ${TW_CACHE_DIR:-~/.cache/timerwheel}/WHAT-build.lock until the script exits,
# so that two checkouts, or a test and `scripts/prebuild.sh` in the background, never build the same
# binary at once: the second waits, then finds it cached.
build_lock() {
    local cache="${TW_CACHE_DIR:-$HOME/.cache/timerwheel}"
    mkdir -p "$cache"
    exec 7>"$cache/$1-build.lock"
    flock 7
}

# Try the package lists we have; refresh them only when the install needs it.
apt_install() {
    log "installing $* with apt-get"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1; then
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null
    fi
}

free_port() {
    "$PYTHON" - <<'EOF'
import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
s.close()
EOF
}

port_free() {
    "$PYTHON" - "$1" <<'EOF'
import socket, sys
s = socket.socket()
# As the server will: a port left in TIME_WAIT by our own last run is free to reuse.
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
finally:
    s.close()
EOF
}

# Stop the server `running_pid` (defined by the sourcing script) names: TERM, KILL after $1 seconds
# (default 10), wait until it is gone; forget its pid either way.
stop_running() {
    local pid i
    pid="$(running_pid)" || { rm -f "$PID_FILE"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < ${1:-10} * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "pid $pid did not stop within ${1:-10}s; killing it"
        kill -KILL "$pid" 2>/dev/null || true
        while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
    fi
    rm -f "$PID_FILE"
}

# The client port, chosen at the first start and kept in STATE across stops and restarts.
port() { cat "$STATE/port"; }

# The pid in PID_FILE while that process runs and its command line matches the grep pattern $1:
# a pid the kernel has given to some other process since is not ours.
pid_matching() {
    local pid
    [[ -f "$PID_FILE" ]] || return 1
    pid="$(cat "$PID_FILE")"
    [[ -n "$pid" && -r "/proc/$pid/cmdline" ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$1" || return 1
    echo "$pid"
}

# A CA and a server certificate for 127.0.0.1 / localhost, made with openssl into directory $1
# (once: kept across restarts): ca.pem (what clients trust), ca.key, server.key, server.pem.
make_tls() {
    local dir="$1"
    [[ -f "$dir/server.pem" ]] && return 0
    command -v openssl >/dev/null || die "openssl is missing: install it (apt-get install openssl)"
    mkdir -p "$dir"
    (
        umask 077
        cd "$dir"
        openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=timerwheel test CA $NAME" \
            -keyout ca.key -out ca.pem >/dev/null 2>&1
        openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr >/dev/null 2>&1
        printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' >server.ext
        openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 \
            -extfile server.ext -out server.pem >/dev/null 2>&1
        rm -f server.csr server.ext
    ) || die "openssl could not make the test CA and certificate in ${dir#"$ROOT"/}"
    chmod 644 "$dir/ca.pem"
}

# A random password in file $1 (mode 600), made once.
make_password() {
    [[ -s "$1" ]] && return 0
    (umask 077; openssl rand -hex 16 >"$1") || die "could not write a password to $1"
}

# TW_LISTEN_HOST: an address of this machine the server should listen on besides 127.0.0.1 (for
# pods of the local Kubernetes cluster: scripts/k8s.sh env prints it as TW_K8S_HOST_IP). Empty:
# 127.0.0.1 only. Refused unless some interface of this machine has it.
listen_host() {
    local h="${TW_LISTEN_HOST:-}"
    [[ -z "$h" || "$h" == 127.0.0.1 ]] && return 0
    [[ "$h" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "TW_LISTEN_HOST=$h is not an IPv4 address"
    ip -4 -o addr show 2>/dev/null | awk '{print $4}' | cut -d/ -f1 | grep -qx "$h" \
        || die "TW_LISTEN_HOST=$h is not an address of this machine (ip -4 addr)"
    echo "$h"
}

# The port is free on address $2 (default 127.0.0.1).
port_free_on() {
    "$PYTHON" - "$1" "${2:-127.0.0.1}" <<'EOF'
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind((sys.argv[2], int(sys.argv[1])))
except OSError:
    sys.exit(1)
finally:
    s.close()
EOF
}

# Java 17 and Maven (what kafka.sh and spark.sh fetch jars with), installed with apt-get as root.
need_java_maven() {
    local missing=()
    command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
    command -v mvn >/dev/null || missing+=(maven)
    ((${#missing[@]} == 0)) && return 0
    [[ $(id -u) == 0 ]] || die "missing ${missing[*]}: install them (apt-get install ${missing[*]})"
    apt_install "${missing[@]}"
}

# maven_fetch POM DIR WHAT GLOB: the runtime jars of POM's dependencies into DIR, once (DIR/.complete).
# Written to a temp dir and renamed, so an interrupted download never leaves a half-filled cache
# behind; GLOB names a jar that must be there, WHAT the download in messages.
maven_fetch() {
    local pom="$1" dir="$2" what="$3" glob="$4" tmp
    [[ -f "$dir/.complete" ]] && return 0
    log "fetching $what with Maven into ${dir#"$ROOT"/} (first run only)"
    mkdir -p "$(dirname "$dir")"
    tmp="$dir.tmp.$$"
    rm -rf "$tmp"
    mkdir -p "$tmp"
    if ! mvn -q -B -f "$pom" dependency:copy-dependencies -DincludeScope=runtime \
        -DoutputDirectory="$tmp" >"$tmp.log" 2>&1; then
        cat "$tmp.log" >&2
        rm -rf "$tmp" "$tmp.log"
        die "Maven could not fetch $what (is Maven Central reachable?)"
    fi
    rm -f "$tmp.log"
    compgen -G "$tmp/$glob" >/dev/null || die "Maven fetched no $glob into $tmp"
    touch "$tmp/.complete"
    rm -rf "$dir"
    mv "$tmp" "$dir" 2>/dev/null || rm -rf "$tmp"  # a concurrent fetch may have won: its copy is the same
    [[ -f "$dir/.complete" ]] || die "no complete jar directory at $dir"
}
