#!/bin/bash
# Container entry of the Spark image: a timerwheel command (`audit ...`, `bulk-schedule ...`,
# `forecast ...`), or a Spark executor.
#
# Spark's Kubernetes scheduler starts each executor pod from this image with the one argument
# `executor` and its settings in SPARK_* variables; this runs what Spark's own image's
# entrypoint.sh runs for it (KubernetesExecutorBackend on PySpark's jars, the JVM options Spark
# passes as SPARK_JAVA_OPT_<n>, in order). The executor works in its first local directory (an
# emptyDir Spark mounts): the jars and files it fetches from the driver land in its working
# directory, and the image's root file system is read-only.
set -euo pipefail

if [[ "${1:-}" != executor ]]; then
    exec timerwheel "$@"
fi

java_opts=()
for var in $(compgen -e | grep '^SPARK_JAVA_OPT_' | sort -t_ -k4 -n); do
    java_opts+=("${!var}")
done
classpath="$SPARK_HOME/jars/*"
if [[ -n "${SPARK_EXTRA_CLASSPATH:-}" ]]; then
    classpath="$classpath:$SPARK_EXTRA_CLASSPATH"
fi
cd "${SPARK_LOCAL_DIRS%%,*}"
exec "$JAVA_HOME/bin/java" "${java_opts[@]}" \
    -Xms"$SPARK_EXECUTOR_MEMORY" -Xmx"$SPARK_EXECUTOR_MEMORY" -cp "$classpath" \
    org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend \
    --driver-url "$SPARK_DRIVER_URL" --executor-id "$SPARK_EXECUTOR_ID" --cores "$SPARK_EXECUTOR_CORES" \
    --app-id "$SPARK_APPLICATION_ID" --hostname "$SPARK_EXECUTOR_POD_IP" \
    --resourceProfileId "$SPARK_RESOURCE_PROFILE_ID" --podName "$SPARK_EXECUTOR_POD_NAME"
