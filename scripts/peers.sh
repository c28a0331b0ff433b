#!/usr/bin/env bash
# The peers `python -m bench peers` runs beside timerwheel, built from source as test infrastructure.
#
#   scripts/peers.sh path etf1      print etf1's scheduler binary, building it first if missing
#   scripts/peers.sh build etf1     build it (again only if missing)
#   scripts/peers.sh version etf1   the version this script builds
#
# etf1: etf1/kafka-message-scheduler (one in-memory Go timer per schedule, confluent-kafka-go),
# module github.com/etf1/kafka-message-scheduler at TW_ETF1_VERSION (default v0.0.9). `go install
# MODULE@VERSION` stops on the proxy's version list, so the module is fetched with `go mod download`,
# copied out of the module cache (read-only there) and built in the copy with
# `CGO_ENABLED=1 go build ./cmd/kafka` (librdkafka comes prebuilt inside confluent-kafka-go; cgo
# links it). The copy and the binary are cached outside the work tree in
# ${TW_CACHE_DIR:-~/.cache/timerwheel}/peers/etf1-VERSION/ (bin/kafka-message-scheduler); the binary
# is built to a temporary name and renamed into place, so an interrupted build never leaves a
# broken binary behind. Needs Go (GO, else `go` on PATH, else /usr/local/go/bin/go), a C compiler
# (gcc) and the Go module proxy.
set -euo pipefail

ETF1_MODULE=github.com/etf1/kafka-message-scheduler
ETF1_VERSION="${TW_ETF1_VERSION:-v0.0.9}"
CACHE="${TW_CACHE_DIR:-$HOME/.cache/timerwheel}"
ETF1_DIR="$CACHE/peers/etf1-$ETF1_VERSION"
ETF1_BIN="$ETF1_DIR/bin/kafka-message-scheduler"

NAME=peers
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

build_etf1() {
    [[ -x "$ETF1_BIN" ]] && return 0
    build_lock etf1
    [[ -x "$ETF1_BIN" ]] && return 0
    local go
    go="$(go_bin)" || die "Go is missing: install Go 1.22+ (or set GO=/path/to/go) to build $ETF1_MODULE $ETF1_VERSION"
    command -v gcc >/dev/null || die "gcc is missing: cgo needs it to link librdkafka (apt-get install gcc)"
    mkdir -p "$ETF1_DIR/bin"
    local work src
    work="$(mktemp -d "${TMPDIR:-/tmp}/tw-etf1-build.XXXXXX")"
    # shellcheck disable=SC2064  # expand now: the path is fixed
    trap "chmod -R u+w '$work' 2>/dev/null; rm -rf '$work'" EXIT
    log "fetching $ETF1_MODULE@$ETF1_VERSION from the Go module proxy"
    # `go mod download` needs a module to run in (the version list is not asked: the version is pinned).
    (cd "$work" && "$go" mod init tw-etf1-fetch >/dev/null 2>&1)
    src="$(cd "$work" && "$go" mod download -json "$ETF1_MODULE@$ETF1_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')" \
        || die "go mod download $ETF1_MODULE@$ETF1_VERSION failed (is the Go module proxy reachable?)"
    [[ -n "$src" && -f "$src/go.mod" ]] || die "go mod download gave no source directory for $ETF1_MODULE@$ETF1_VERSION"
    rm -rf "$ETF1_DIR/src"
    cp -r "$src" "$ETF1_DIR/src.tmp.$$"
    chmod -R u+w "$ETF1_DIR/src.tmp.$$"
    mv "$ETF1_DIR/src.tmp.$$" "$ETF1_DIR/src"
    log "building $ETF1_MODULE $ETF1_VERSION with $go (cgo, a few minutes the first time)"
    (cd "$ETF1_DIR/src" && CGO_ENABLED=1 "$go" build -trimpath -ldflags "-X main.version=$ETF1_VERSION" \
        -o "$work/kafka-message-scheduler" ./cmd/kafka) \
        || die "go build ./cmd/kafka of $ETF1_MODULE $ETF1_VERSION failed (its dependencies come from the Go module proxy)"
    local tmp="$ETF1_BIN.tmp.$$"
    cp "$work/kafka-message-scheduler" "$tmp"
    chmod 0755 "$tmp"
    mv -f "$tmp" "$ETF1_BIN"
    log "built $ETF1_BIN"
}

peer="${2:-}"
[[ "$peer" == etf1 ]] || die "unknown peer '${peer}' (known: etf1); usage: scripts/peers.sh path|build|version etf1"
case "${1:-}" in
    path) build_etf1; echo "$ETF1_BIN" ;;
    build) build_etf1 ;;
    version) echo "$ETF1_VERSION" ;;
    *) die "usage: scripts/peers.sh path|build|version etf1" ;;
esac
