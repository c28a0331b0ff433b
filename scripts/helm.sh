#!/usr/bin/env bash
# The helm binary for the chart tests, built from source with Go (no download of a release tarball).
#
#   scripts/helm.sh path      print the binary's path, building it first if it is missing
#   scripts/helm.sh build     build it (again only if missing)
#   scripts/helm.sh version   the version this script builds
#   scripts/helm.sh ARGS...   run helm ARGS
#
# Builds helm.sh/helm/v3/cmd/helm at TW_HELM_VERSION (default v3.22.0) in a throwaway wrapper
# module and caches it outside the work tree in ${TW_CACHE_DIR:-~/.cache/timerwheel}/bin/helm-VERSION.
# The binary is built to a temporary name and renamed into place, so an interrupted build never
# leaves a broken binary behind. Needs Go (GO, else `go` on PATH, else /usr/local/go/bin/go) and the
# Go module proxy.
set -euo pipefail

VERSION="${TW_HELM_VERSION:-v3.22.0}"
CACHE="${TW_CACHE_DIR:-$HOME/.cache/timerwheel}"
BIN_DIR="$CACHE/bin"
HELM="$BIN_DIR/helm-$VERSION"

NAME=helm
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

build() {
    [[ -x "$HELM" ]] && return 0
    build_lock helm
    [[ -x "$HELM" ]] && return 0
    local go
    go="$(go_bin)" || die "Go is missing: install Go 1.24+ (or set GO=/path/to/go) to build helm $VERSION"
    mkdir -p "$BIN_DIR"
    local work
    work="$(mktemp -d "${TMPDIR:-/tmp}/tw-helm-build.XXXXXX")"
    # shellcheck disable=SC2064  # expand now: the path is fixed
    trap "rm -rf '$work'" EXIT
    log "building helm $VERSION with $go (a few minutes the first time)"
    (
        cd "$work"
        "$go" mod init tw-helm-wrapper >/dev/null 2>&1
        cat >tools.go <<'EOF'
//go:build tools

package tools

import _ "helm.sh/helm/v3/cmd/helm"
EOF
        # get the package (not only the module), so go.sum covers its whole import graph
        "$go" get "helm.sh/helm/v3/cmd/helm@$VERSION" >/dev/null 2>&1 \
            || die "go get helm.sh/helm/v3/cmd/helm@$VERSION failed (is the Go module proxy reachable?)"
        # As helm's Makefile: the default Kubernetes version of `helm template` and `helm lint`
        # follows the client-go it is built with (else it is v1.20, and kubeVersion checks fail).
        local kv major minor
        kv="$("$go" list -f '{{.Version}}' -m k8s.io/client-go)"   # v0.MINOR.PATCH
        major=$(( $(cut -d. -f1 <<<"${kv#v}") + 1 ))
        minor="$(cut -d. -f2 <<<"$kv")"
        local pkg=helm.sh/helm/v3
        CGO_ENABLED=0 "$go" build -trimpath -ldflags "-s -w -X $pkg/internal/version.version=$VERSION \
            -X $pkg/pkg/lint/rules.k8sVersionMajor=$major -X $pkg/pkg/lint/rules.k8sVersionMinor=$minor \
            -X $pkg/pkg/chartutil.k8sVersionMajor=$major -X $pkg/pkg/chartutil.k8sVersionMinor=$minor" \
            -o "$work/helm" helm.sh/helm/v3/cmd/helm
    )
    local tmp="$HELM.tmp.$$"
    cp "$work/helm" "$tmp"
    chmod 0755 "$tmp"
    mv -f "$tmp" "$HELM"
    log "built $HELM"
}

case "${1:-path}" in
    path) build; echo "$HELM" ;;
    build) build ;;
    version) echo "$VERSION" ;;
    *) build; exec "$HELM" "$@" ;;
esac
