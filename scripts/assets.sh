#!/usr/bin/env bash
# The console's browser libraries, fetched from the npm registry with npm and vendored into the
# package at build time (never committed as minified blobs: the pinned version and its integrity
# below are the record, and a fresh clone gets the same bytes).
#
#   scripts/assets.sh fetch    fetch (cached) and copy into libs/timerwheel/console/static/vendor/
#   scripts/assets.sh check    exit 1, naming what is missing, unless the vendored files are there
#
# uPlot (MIT, ~50 KB): the console's time-series and bar charts. `npm pack` downloads the
# package's tarball into ${TW_CACHE_DIR:-~/.cache/timerwheel}/npm (npm's own cache beside it),
# the tarball's sha512 is checked against UPLOT_INTEGRITY (the registry's dist.integrity), and
# dist/uPlot.iife.min.js, dist/uPlot.min.css and LICENSE are copied into the package. `make
# assets` runs `fetch` (make test, bench, k8s-up and the image need it; make run does not);
# services/Dockerfile refuses to build without the files.
set -euo pipefail

UPLOT_VERSION=1.6.32
UPLOT_INTEGRITY="sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+jabjLgSLMasNuGGzQm/ep3tOkyTxpiQIw=="

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${TW_CACHE_DIR:-$HOME/.cache/timerwheel}/npm"
VENDOR="$ROOT/libs/timerwheel/console/static/vendor"
FILES=(uPlot.iife.min.js uPlot.min.css uPlot.LICENSE)

log() { echo "assets.sh: $*" >&2; }
die() { log "$*"; exit 1; }

check() {
    local f missing=()
    for f in "${FILES[@]}"; do [[ -s "$VENDOR/$f" ]] || missing+=("$f"); done
    ((${#missing[@]} == 0)) && return 0
    die "missing in ${VENDOR#"$ROOT"/}: ${missing[*]} (run scripts/assets.sh fetch; it needs npm and the npm registry)"
}

integrity_of() {  # the sha512 of file $1 in npm's "sha512-<base64>" form
    echo "sha512-$(openssl dgst -sha512 -binary "$1" | base64 -w0)"
}

fetch() {
    local tarball="$CACHE/uplot-$UPLOT_VERSION.tgz"
    if [[ ! -s "$tarball" || "$(integrity_of "$tarball")" != "$UPLOT_INTEGRITY" ]]; then
        command -v npm >/dev/null || die "npm is missing: install it (apt-get install npm) to fetch uPlot $UPLOT_VERSION"
        mkdir -p "$CACHE"
        local work
        work="$(mktemp -d "$CACHE/pack.XXXXXX")"
        # shellcheck disable=SC2064  # expand now: the path is fixed
        trap "rm -rf '$work'" EXIT
        log "fetching uplot@$UPLOT_VERSION with npm (first run only)"
        (cd "$work" && npm pack "uplot@$UPLOT_VERSION" --cache "$CACHE/cache" --silent >/dev/null) \
            || die "npm pack uplot@$UPLOT_VERSION failed (is the npm registry reachable?)"
        [[ -s "$work/uplot-$UPLOT_VERSION.tgz" ]] || die "npm pack wrote no uplot-$UPLOT_VERSION.tgz"
        mv -f "$work/uplot-$UPLOT_VERSION.tgz" "$tarball"
    fi
    local got
    got="$(integrity_of "$tarball")"
    [[ "$got" == "$UPLOT_INTEGRITY" ]] || { rm -f "$tarball"; die "uplot-$UPLOT_VERSION.tgz has integrity $got, expected $UPLOT_INTEGRITY"; }
    local out
    out="$(mktemp -d "${TMPDIR:-/tmp}/tw-assets.XXXXXX")"
    tar -xzf "$tarball" -C "$out" package/dist/uPlot.iife.min.js package/dist/uPlot.min.css package/LICENSE \
        || die "uplot-$UPLOT_VERSION.tgz lacks dist/uPlot.iife.min.js, dist/uPlot.min.css or LICENSE"
    mkdir -p "$VENDOR"
    cp "$out/package/dist/uPlot.iife.min.js" "$out/package/dist/uPlot.min.css" "$VENDOR/"
    cp "$out/package/LICENSE" "$VENDOR/uPlot.LICENSE"
    rm -rf "$out"
    check
}

case "${1:-fetch}" in
    fetch) fetch ;;
    check) check ;;
    *) die "usage: scripts/assets.sh fetch|check" ;;
esac
