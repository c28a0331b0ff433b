#!/usr/bin/env bash
# A local OCI image registry (CNCF distribution's `registry`), as a private registry stands in for
# a cluster that is not ours: plain HTTP, basic auth, images pushed with skopeo and pulled by the
# local cluster's containerd with a pull secret (e2e/test_k8s_helm.py, docs/helm.md).
#
#   scripts/registry.sh path     print the binary's path, building it first if it is missing
#   scripts/registry.sh up       build what is missing, start it, wait until /v2/ answers
#   scripts/registry.sh down     stop it and delete what it stored
#   scripts/registry.sh status   exit 0 when running and answering
#   scripts/registry.sh env      print TW_REGISTRY=HOST:PORT, TW_REGISTRY_USER and
#                                TW_REGISTRY_PASSWORD_FILE (the password, mode 600)
#
# Builds github.com/distribution/distribution/v3/cmd/registry at TW_REGISTRY_VERSION (default
# v3.1.2) from the Go module proxy in a throwaway wrapper module (as scripts/helm.sh builds helm),
# cached in ${TW_CACHE_DIR:-~/.cache/timerwheel}/bin/registry-VERSION, written to a temp name and
# renamed. The password is bcrypt-hashed with htpasswd (Debian's apache2-utils, installed as root
# when missing). State (config, htpasswd, the stored images, log, pid, port) lives in
# .run/registry/; .run/registry.env holds what `env` prints. The port is chosen free at the first
# start and kept. `up` on a running, healthy registry does nothing.
#
# TW_LISTEN_HOST=<an address of this machine> (e.g. the node address `scripts/k8s.sh env` prints)
# makes it listen there instead of 127.0.0.1, read when the registry is first made: pods pull from
# it through containerd, which must be told the address speaks plain HTTP (scripts/k8s.sh
# trust-registry HOST:PORT). Environment also: TW_REGISTRY_START_TIMEOUT (s, default 30), GO.
set -euo pipefail

NAME=registry
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VERSION="${TW_REGISTRY_VERSION:-v3.1.2}"
CACHE="${TW_CACHE_DIR:-$HOME/.cache/timerwheel}"
BIN="$CACHE/bin/registry-$VERSION"
START_TIMEOUT="${TW_REGISTRY_START_TIMEOUT:-30}"
USER_NAME=timerwheel

build() {
    [[ -x "$BIN" ]] && return 0
    build_lock registry
    [[ -x "$BIN" ]] && return 0
    local go work
    go="$(go_bin)" || die "Go is missing: install Go 1.24+ (or set GO=/path/to/go) to build the registry $VERSION"
    mkdir -p "$(dirname "$BIN")"
    work="$(mktemp -d "${TMPDIR:-/tmp}/tw-registry-build.XXXXXX")"
    # shellcheck disable=SC2064  # expand now: the path is fixed
    trap "rm -rf '$work'" EXIT
    log "building the registry $VERSION with $go (a few minutes the first time)"
    (
        cd "$work"
        "$go" mod init tw-registry-wrapper >/dev/null 2>&1
        printf '//go:build tools\n\npackage tools\n\nimport _ "github.com/distribution/distribution/v3/cmd/registry"\n' >tools.go
        "$go" get "github.com/distribution/distribution/v3/cmd/registry@$VERSION" >/dev/null 2>&1 ||
            die "go get github.com/distribution/distribution/v3/cmd/registry@$VERSION failed (is the Go module proxy reachable?)"
        CGO_ENABLED=0 "$go" build -trimpath -ldflags "-s -w" -o "$work/registry" \
            github.com/distribution/distribution/v3/cmd/registry
    ) || die "go build of the registry $VERSION failed"
    cp "$work/registry" "$BIN.tmp.$$"
    chmod 0755 "$BIN.tmp.$$"
    mv -f "$BIN.tmp.$$" "$BIN"
    log "built $BIN"
}

need_htpasswd() {
    command -v htpasswd >/dev/null && return 0
    [[ $(id -u) == 0 ]] || die "htpasswd is missing: install it (apt-get install apache2-utils)"
    apt_install apache2-utils
}

host() { cat "$STATE/host"; }
address() { echo "$(host):$(port)"; }

# /v2/ answers 401 without credentials and 200 with them: both mean the registry serves.
healthy() {
    [[ -f "$STATE/port" ]] || return 1
    "$PYTHON" - "$(address)" "$USER_NAME" "$STATE/password" <<'EOF' >/dev/null 2>&1
import base64, sys, urllib.request
address, user, password = sys.argv[1], sys.argv[2], open(sys.argv[3]).read().strip()
req = urllib.request.Request(f"http://{address}/v2/", headers={
    "Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()})
with urllib.request.urlopen(req, timeout=2) as resp:
    sys.exit(0 if resp.status == 200 else 1)
EOF
}

running_pid() { pid_matching "registry-$VERSION serve"; }

write_env() {
    {
        echo "TW_REGISTRY=$(address)"
        echo "TW_REGISTRY_USER=$USER_NAME"
        echo "TW_REGISTRY_PASSWORD_FILE=$STATE/password"
    } >"$ENV_FILE"
}

# Made once, at the first start: the address, the password and its bcrypt hash, the config.
make_state() {
    local h
    h="$(listen_host)"
    mkdir -p "$STATE/data"
    echo "${h:-127.0.0.1}" >"$STATE/host"
    free_port >"$STATE/port"
    make_password "$STATE/password"
    need_htpasswd
    (umask 077; htpasswd -nbB "$USER_NAME" "$(cat "$STATE/password")" | head -1 >"$STATE/htpasswd")
    cat >"$STATE/config.yml" <<EOF
version: 0.1
log: {level: info, formatter: text}
storage:
  filesystem: {rootdirectory: $STATE/data}
  delete: {enabled: true}
http:
  addr: $(address)
auth:
  htpasswd: {realm: timerwheel-local, path: $STATE/htpasswd}
EOF
}

launch() {
    local pid deadline
    port_free_on "$(port)" "$(host)" || die "port $(address) is taken by another process; run 'scripts/registry.sh down' and 'up'"
    setsid nohup "$BIN" serve "$STATE/config.yml" >>"$STATE/registry.log" 2>&1 </dev/null 9>&- &
    pid=$!
    echo "$pid" >"$PID_FILE"
    deadline=$((SECONDS + START_TIMEOUT))
    until healthy; do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 20 "$STATE/registry.log" >&2 2>/dev/null || true
            rm -f "$PID_FILE"
            die "the registry exited during start (log in ${STATE#"$ROOT"/}/registry.log)"
        fi
        ((SECONDS < deadline)) || die "the registry did not answer on $(address) within ${START_TIMEOUT}s"
        sleep 0.2
    done
    write_env
    log "registry up on $(address) (pid $pid; user $USER_NAME, password in ${STATE#"$ROOT"/}/password)"
}


cmd_up() {
    build
    if [[ -f "$STATE/port" ]] && running_pid >/dev/null && healthy; then
        write_env
        return 0
    fi
    [[ -f "$STATE/port" ]] && stop_running 10
    [[ -f "$STATE/config.yml" ]] || make_state
    launch
}

main() {
    local verb="${1:-}"
    mkdir -p "$RUN"
    case "$verb" in
    path) build; echo "$BIN"; return 0 ;;
    env)
        [[ -f "$ENV_FILE" ]] || die "no registry started: run 'scripts/registry.sh up'"
        cat "$ENV_FILE"
        return 0
        ;;
    status)
        running_pid >/dev/null && healthy && { echo "running on $(address)"; return 0; }
        echo "not running"
        return 1
        ;;
    up | down) ;;
    *) die "usage: scripts/registry.sh path|up|down|status|env" ;;
    esac
    exec 9>"$RUN/$NAME.lock"
    flock 9
    case "$verb" in
    up) cmd_up ;;
    down)
        [[ -f "$STATE/port" ]] && stop_running 10
        rm -rf "$STATE" "$ENV_FILE"
        ;;
    esac
    return 0
}

main "$@"
