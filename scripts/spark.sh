#!/usr/bin/env bash
# Spark's Kafka connector for the Spark jobs (timerwheel audit, bulk-schedule, forecast).
#
#   scripts/spark.sh fetch    fetch org.apache.spark:spark-sql-kafka-0-10_2.13 (the PySpark
#                             release pinned in pyproject.toml) and its runtime jars with Maven,
#                             once per version; install Java 17 and Maven with apt-get if missing
#   scripts/spark.sh jars     print the jars, comma-separated: what the jobs pass as spark.jars
#                             (fetching first if needed)
#   scripts/spark.sh dir      print the jar directory (TW_SPARK_JARS takes the same path)
#
# The jars come from Maven Central through scripts/spark/pom.xml into
# ${TW_CACHE_DIR:-~/.cache/timerwheel}/spark/<pom hash>/jars, outside the work tree, so every
# checkout on the machine shares one download. A job elsewhere may use --packages instead
# (Spark's own resolver), or point TW_SPARK_JARS at a directory of these jars.
set -euo pipefail

NAME=spark
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

POM="$ROOT/scripts/spark/pom.xml"
CACHE="${TW_CACHE_DIR:-$HOME/.cache/timerwheel}"

need_tools() {
    local missing=()
    command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
    command -v mvn >/dev/null || missing+=(maven)
    ((${#missing[@]} == 0)) && return 0
    [[ $(id -u) == 0 ]] || die "missing ${missing[*]}: install them (apt-get install ${missing[*]})"
    apt_install "${missing[@]}"
}

jars_dir() { echo "$CACHE/spark/$(sha256sum "$POM" | cut -c1-12)/jars"; }

# Written to a temp dir and renamed, so an interrupted download never leaves a half-filled cache.
fetch() {
    local jars tmp
    jars="$(jars_dir)"
    [[ -f "$jars/.complete" ]] && return 0
    need_tools
    log "fetching Spark's Kafka connector ($(grep -o '<spark.version>[^<]*' "$POM" | cut -d'>' -f2)) with Maven into $jars (first run only)"
    mkdir -p "$(dirname "$jars")"
    tmp="$jars.tmp.$$"
    rm -rf "$tmp"
    mkdir -p "$tmp"
    if ! mvn -q -B -f "$POM" dependency:copy-dependencies -DincludeScope=runtime \
        -DoutputDirectory="$tmp" >"$tmp.log" 2>&1; then
        cat "$tmp.log" >&2
        rm -rf "$tmp" "$tmp.log"
        die "Maven could not fetch spark-sql-kafka-0-10 (is Maven Central reachable?)"
    fi
    rm -f "$tmp.log"
    ls "$tmp"/spark-sql-kafka-0-10_2.13-*.jar >/dev/null 2>&1 || die "Maven fetched no spark-sql-kafka-0-10 jar into $tmp"
    touch "$tmp/.complete"
    rm -rf "$jars"
    mv "$tmp" "$jars" 2>/dev/null || rm -rf "$tmp"  # a concurrent fetch may have won: its copy is the same
    [[ -f "$jars/.complete" ]] || die "no complete jar directory at $jars"
}

case "${1:-}" in
    fetch) fetch ;;
    jars) fetch; ls "$(jars_dir)"/*.jar | paste -sd, - ;;
    dir) fetch; jars_dir ;;
    *) echo "usage: scripts/spark.sh fetch|jars|dir" >&2; exit 2 ;;
esac
