#!/usr/bin/env bash
# Headless Chromium and its WebDriver for the console's browser tests (e2e/test_console_browser.py).
#
#   scripts/chromium.sh path    install Debian's chromium and chromium-driver if missing (apt-get,
#                               as root), then print the two paths: the browser, then chromedriver
#
# Debian's packages, not a browser build downloaded by a driver manager: the two come from the
# same source package, so their versions always agree.
set -euo pipefail

NAME=chromium
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

need_browser() {
    command -v chromium >/dev/null && command -v chromedriver >/dev/null && return 0
    [[ $(id -u) == 0 ]] || die "chromium and chromium-driver are missing: install them (apt-get install chromium chromium-driver)"
    apt_install chromium chromium-driver
    command -v chromium >/dev/null && command -v chromedriver >/dev/null \
        || die "apt-get installed chromium and chromium-driver, yet chromium or chromedriver is not on PATH"
}

case "${1:-path}" in
    path) need_browser; command -v chromium; command -v chromedriver ;;
    *) die "usage: scripts/chromium.sh path" ;;
esac
