#!/usr/bin/env bash
# Prometheus and promtool for the monitoring tests (e2e/test_k8s_monitoring.py), built from source
# with Go (the Go module proxy; no release tarball is downloaded).
#
#   scripts/prometheus.sh path      print the two binaries' paths (prometheus, then promtool),
#                                   building them first if missing
#   scripts/prometheus.sh build     build them (again only if missing)
#   scripts/prometheus.sh version   the version this script builds
#   scripts/prometheus.sh crds      print the directory holding the Prometheus Operator's CRDs
#                                   (monitoring.coreos.com_*.yaml) of TW_PROMETHEUS_OPERATOR_VERSION
#                                   (default v0.85.0): its Go module, fetched into Go's module cache
#
# Builds github.com/prometheus/prometheus/cmd/{prometheus,promtool} at TW_PROMETHEUS_VERSION
# (default v0.316.0, the Go module version of Prometheus 3.16.0) in a throwaway wrapper module and
# caches them outside the work tree in ${TW_CACHE_DIR:-~/.cache/timerwheel}/bin. Only Kubernetes
# service discovery is compiled in (Prometheus' own build tags remove_all_sd,enable_kubernetes_sd),
# and the web UI's assets are not embedded (its HTTP API, which the tests use, is all there). Each
# binary is built to a temporary name and renamed into place, so an interrupted build never leaves
# a broken binary behind. Needs Go (GO, else `go` on PATH, else /usr/local/go/bin/go).
set -euo pipefail

VERSION="${TW_PROMETHEUS_VERSION:-v0.316.0}"
CACHE="${TW_CACHE_DIR:-$HOME/.cache/timerwheel}"
BIN_DIR="$CACHE/bin"
PROMETHEUS="$BIN_DIR/prometheus-$VERSION"
PROMTOOL="$BIN_DIR/promtool-$VERSION"
MODULE=github.com/prometheus/prometheus
OPERATOR_VERSION="${TW_PROMETHEUS_OPERATOR_VERSION:-v0.85.0}"
OPERATOR_MODULE=github.com/prometheus-operator/prometheus-operator

NAME=prometheus
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

build() {
    [[ -x "$PROMETHEUS" && -x "$PROMTOOL" ]] && return 0
    build_lock prometheus
    [[ -x "$PROMETHEUS" && -x "$PROMTOOL" ]] && return 0
    local go
    go="$(go_bin)" || die "Go is missing: install Go 1.25+ (or set GO=/path/to/go) to build Prometheus $VERSION"
    mkdir -p "$BIN_DIR"
    local work
    work="$(mktemp -d "${TMPDIR:-/tmp}/tw-prometheus-build.XXXXXX")"
    # shellcheck disable=SC2064  # expand now: the path is fixed
    trap "rm -rf '$work'" EXIT
    log "building prometheus and promtool $VERSION with $go (several minutes the first time)"
    (
        cd "$work"
        "$go" mod init tw-prometheus-wrapper >/dev/null 2>&1
        cat >tools.go <<'EOF'
//go:build tools

package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
EOF
        "$go" get "$MODULE/cmd/prometheus@$VERSION" "$MODULE/cmd/promtool@$VERSION" >/dev/null 2>&1 \
            || die "go get $MODULE@$VERSION failed (is the Go module proxy reachable?)"
        local tags=remove_all_sd,enable_kubernetes_sd
        local ver="${VERSION#v0.}"  # v0.316.0 -> 3.16.0, as Prometheus' own build stamps it
        ver="$(( ${ver%%.*} / 100 )).$(( ${ver%%.*} % 100 )).${ver#*.}"
        local ldflags="-s -w -X github.com/prometheus/common/version.Version=$ver"
        CGO_ENABLED=0 "$go" build -trimpath -tags "$tags" -ldflags "$ldflags" -o "$work/prometheus" "$MODULE/cmd/prometheus"
        CGO_ENABLED=0 "$go" build -trimpath -tags "$tags" -ldflags "$ldflags" -o "$work/promtool" "$MODULE/cmd/promtool"
    )
    local name
    for name in prometheus promtool; do
        local target="$BIN_DIR/$name-$VERSION" tmp="$BIN_DIR/$name-$VERSION.tmp.$$"
        cp "$work/$name" "$tmp"
        chmod 0755 "$tmp"
        mv -f "$tmp" "$target"
    done
    log "built $PROMETHEUS and $PROMTOOL"
}

crds() {
    local go dir work
    go="$(go_bin)" || die "Go is missing: install Go (or set GO=/path/to/go) to fetch $OPERATOR_MODULE $OPERATOR_VERSION"
    work="$(mktemp -d "${TMPDIR:-/tmp}/tw-prometheus-crds.XXXXXX")"
    # outside any module: `go mod download` of one module
    dir="$(cd "$work" && "$go" mod download -json "$OPERATOR_MODULE@$OPERATOR_VERSION" 2>/dev/null \
        | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
    rm -rf "$work"
    [[ -n "$dir" && -f "$dir/example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml" ]] \
        || die "go mod download $OPERATOR_MODULE@$OPERATOR_VERSION gave no example/prometheus-operator-crd (is the Go module proxy reachable?)"
    echo "$dir/example/prometheus-operator-crd"
}

case "${1:-path}" in
    path) build; echo "$PROMETHEUS"; echo "$PROMTOOL" ;;
    build) build ;;
    version) echo "$VERSION" ;;
    crds) crds ;;
    *) die "usage: scripts/prometheus.sh path|build|version|crds" ;;
esac
