#!/usr/bin/env bash
# Build the test infrastructure's binaries ahead of the tests that need them, at low priority.
#
#   scripts/prebuild.sh               build what is missing: helm, Prometheus and promtool, the OCI
#                                     registry, then the Kubernetes binaries (as root only)
#   scripts/prebuild.sh --background  the same in the background (`make test` starts it first),
#                                     its log in ${TW_CACHE_DIR:-~/.cache/timerwheel}/prebuild.log
#
# On a fresh machine these builds take about twenty minutes. Run inside the test session's fixtures
# they would come one after the other, each while the suite waits; started here they overlap with
# the tests that need none of them (the cluster tests run last). Each build holds its lock in the
# cache, so a test that needs a binary still being built here waits for it instead of building it
# again. With everything cached this finishes at once.
set -uo pipefail

NAME=prebuild
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
CACHE="${TW_CACHE_DIR:-$HOME/.cache/timerwheel}"

if [[ "${1:-}" == --background ]]; then
    mkdir -p "$CACHE"
    nohup nice -n 19 "$0" >"$CACHE/prebuild.log" 2>&1 </dev/null &
    exit 0
fi
[[ $# -eq 0 ]] || die "usage: scripts/prebuild.sh [--background]"

cd "$ROOT" || exit 1
status=0
step() {
    local started=$SECONDS
    if "$@" >/dev/null; then
        log "$* done in $((SECONDS - started)) s"
    else
        log "$* failed (the test that needs it builds it again and says why)"
        status=1
    fi
}
step scripts/helm.sh build
step scripts/prometheus.sh build
step scripts/registry.sh path
if [[ $(id -u) == 0 ]]; then
    step scripts/k8s.sh build
else
    log "not root: the Kubernetes binaries are built by the cluster tests' fixture (which needs root)"
fi
exit $status
