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

jars_dir() { echo "$CACHE/spark/$(sha256sum "$POM" | cut -c1-12)/jars"; }

fetch() {
    [[ -f "$(jars_dir)/.complete" ]] && return 0
    need_java_maven
    maven_fetch "$POM" "$(jars_dir)" "Spark's Kafka connector ($(grep -o '<spark.version>[^<]*' "$POM" | cut -d'>' -f2))" \
        'spark-sql-kafka-0-10_2.13-*.jar'
}

case "${1:-}" in
    fetch) fetch ;;
    jars) fetch; ls "$(jars_dir)"/*.jar | paste -sd, - ;;
    dir) fetch; jars_dir ;;
    *) echo "usage: scripts/spark.sh fetch|jars|dir" >&2; exit 2 ;;
esac
