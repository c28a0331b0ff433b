#!/usr/bin/env bash
# A local single-node Apache Kafka (KRaft, broker + controller in one JVM) on 127.0.0.1.
#
#   scripts/kafka.sh up        fetch the broker with Maven (first time), format, start, wait until it answers
#   scripts/kafka.sh down      stop it and delete its data
#   scripts/kafka.sh stop      stop it, keep data and port (`start` or `up` brings the same broker back)
#   scripts/kafka.sh start     start the stopped broker again (same data, same port)
#   scripts/kafka.sh restart   stop + start: what chaos tests call to bounce the broker mid-run
#   scripts/kafka.sh status    exit 0 when running and answering
#   scripts/kafka.sh env       print TW_KAFKA_BOOTSTRAP=127.0.0.1:PORT (and, with an external
#                              listener, TW_KAFKA_EXTERNAL_BOOTSTRAP=HOST:PORT2)
#
# The broker jars come from Maven Central through scripts/kafka/pom.xml (a pinned version) into
# .cache/kafka/<pom hash>/libs, outside the tracked files. State lives in .run/kafka/ (data,
# generated server.properties, logs, pid, ports); .run/kafka.env holds the bootstrap address.
# Ports are chosen free at the first start and kept, so restarts keep clients' addresses valid.
# `up` on a running, healthy broker does nothing. Every step holds a lock, so concurrent callers
# (two test sessions) share one broker.
#
# TW_LISTEN_HOST=<an address of this machine> (e.g. the node address `scripts/k8s.sh env` prints)
# adds a second listener on that address, advertised as itself, for pods of the local cluster;
# the 127.0.0.1 listener stays as it is. `up` with it restarts a running broker that lacks it
# (same data, same ports); once added it stays until `down`.
#
# Environment: TW_KAFKA_HEAP (default -Xmx512m -Xms512m), TW_KAFKA_START_TIMEOUT (s, default 120),
# PYTHON (used for the health check; default .venv/bin/python, else python3),
# TW_KAFKA_INSTANCE (a second, independent broker: state in .run/kafka-<instance>/, address in
# .run/kafka-<instance>.env), TW_KAFKA_AUTO_CREATE (true|false, default true: whether the broker
# creates a topic on first use; read when the instance is first made, as managed services set it),
# TW_KAFKA_SASL_SSL (true|false, default false; read when the instance is first made): a SASL_SSL
# listener beside the plaintext one, its certificate signed by a CA made locally with openssl
# (.run/<instance>/tls/ca.pem), user "timerwheel" for SCRAM-SHA-512, SCRAM-SHA-256 (made by Kafka's
# storage tool at format time) and PLAIN; .env then also holds TW_KAFKA_SASL_SSL_BOOTSTRAP,
# TW_KAFKA_SASL_SSL_CAFILE, TW_KAFKA_SASL_SSL_USERNAME, TW_KAFKA_SASL_SSL_PASSWORD_FILE.
# E.g. TW_KAFKA_INSTANCE=secure TW_KAFKA_SASL_SSL=true scripts/kafka.sh up (what the tests run).
set -euo pipefail

NAME=kafka${TW_KAFKA_INSTANCE:+-$TW_KAFKA_INSTANCE}
[[ "${TW_KAFKA_INSTANCE:-}" =~ ^[a-z0-9-]*$ ]] || { echo "kafka.sh: TW_KAFKA_INSTANCE must be [a-z0-9-]*, got '$TW_KAFKA_INSTANCE'" >&2; exit 1; }
AUTO_CREATE="${TW_KAFKA_AUTO_CREATE:-true}"
[[ "$AUTO_CREATE" == true || "$AUTO_CREATE" == false ]] || { echo "kafka.sh: TW_KAFKA_AUTO_CREATE must be true or false, got '$AUTO_CREATE'" >&2; exit 1; }
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SASL_SSL="${TW_KAFKA_SASL_SSL:-false}"
[[ "$SASL_SSL" == true || "$SASL_SSL" == false ]] || die "TW_KAFKA_SASL_SSL must be true or false, got '$SASL_SSL'"
SASL_USER=timerwheel

POM="$ROOT/scripts/kafka/pom.xml"
HEAP="${TW_KAFKA_HEAP:--Xmx512m -Xms512m}"
START_TIMEOUT="${TW_KAFKA_START_TIMEOUT:-120}"

libs_dir() {
    local hash
    hash="$(sha256sum "$POM" | cut -c1-12)"
    echo "$ROOT/.cache/kafka/$hash/libs"
}

# Fetch the broker jars once per pom version.
fetch() {
    maven_fetch "$POM" "$(libs_dir)" "Apache Kafka ($(grep -o '<kafka.version>[^<]*' "$POM" | cut -d'>' -f2))" 'kafka_2.13-*.jar'
}

# Only our broker: the pid must still be a kafka.Kafka JVM reading our config.
running_pid() { pid_matching "kafka.Kafka $STATE/server.properties"; }

bootstrap() { echo "127.0.0.1:$(port)"; }

# The broker answers metadata requests and lists itself: it is registered and unfenced.
healthy() {
    local addr
    addr="$(bootstrap)"
    if "$PYTHON" -c 'import kafka' 2>/dev/null; then
        "$PYTHON" - "$addr" <<'EOF' >/dev/null 2>&1
import sys
from kafka import KafkaAdminClient
admin = KafkaAdminClient(bootstrap_servers=sys.argv[1], request_timeout_ms=3000, bootstrap_timeout_ms=3000)
try:
    sys.exit(0 if admin.describe_cluster().get("brokers") else 1)
finally:
    admin.close()
EOF
    else
        # No kafka-python here: the broker logs this line once it is unfenced.
        grep -q "Kafka Server started" "$STATE/logs/server.log" 2>/dev/null
    fi
}

external() { [[ -f "$STATE/external-host" ]] && echo "$(cat "$STATE/external-host"):$(cat "$STATE/external-port")"; }

write_env() {
    echo "TW_KAFKA_BOOTSTRAP=$(bootstrap)" >"$ENV_FILE"
    if external >/dev/null; then echo "TW_KAFKA_EXTERNAL_BOOTSTRAP=$(external)" >>"$ENV_FILE"; fi
    sasl_ssl_env >>"$ENV_FILE"
}

write_config() {
    local port="$1" cport="$2" listeners advertised protocols
    mkdir -p "$STATE/data" "$STATE/logs"
    echo "$port" >"$STATE/port"
    echo "$cport" >"$STATE/controller-port"
    listeners="PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport"
    advertised="PLAINTEXT://127.0.0.1:$port"
    protocols="PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
    if external >/dev/null; then
        listeners="$listeners,EXTERNAL://$(external)"
        advertised="$advertised,EXTERNAL://$(external)"
        protocols="$protocols,EXTERNAL:PLAINTEXT"
    fi
    cat >"$STATE/server.properties" <<EOF
# Generated by scripts/kafka.sh: a single-node KRaft broker for development and tests.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$cport
listeners=$listeners
advertised.listeners=$advertised
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=$protocols
log.dirs=$STATE/data
num.partitions=1
default.replication.factor=1
min.insync.replicas=1
auto.create.topics.enable=$AUTO_CREATE
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=4
log.retention.hours=168
log.segment.bytes=268435456
log.retention.check.interval.ms=60000
# Tests drive time with a simulated clock that may stamp records months ahead: accept them
# (Kafka 4 rejects timestamps more than one hour in the future by default).
log.message.timestamp.after.max.ms=9223372036854775807
EOF
    cat >"$STATE/log4j2.properties" <<'EOF'
status = warn
appender.file.type = RollingFile
appender.file.name = file
appender.file.fileName = ${sys:kafka.logs.dir}/server.log
appender.file.filePattern = ${sys:kafka.logs.dir}/server.log.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 20MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
logger.statechange.name = state.change.logger
logger.statechange.level = warn
logger.request.name = kafka.request.logger
logger.request.level = warn
EOF
}

# The SASL_SSL listener (TW_KAFKA_SASL_SSL=true) on port $1: added to the generated config, so
# the plaintext listener and everything else stay as write_config made them.
add_sasl_ssl_listener() {
    local sport="$1" tls="$STATE/tls" password
    make_tls "$tls"
    make_password "$tls/$SASL_USER.password"
    make_password "$tls/keystore.password"
    password="$(cat "$tls/$SASL_USER.password")"
    openssl pkcs12 -export -in "$tls/server.pem" -inkey "$tls/server.key" -name broker \
        -passout "file:$tls/keystore.password" -out "$tls/broker.p12" >/dev/null 2>&1 \
        || die "openssl could not make the broker's keystore ${tls#"$ROOT"/}/broker.p12"
    echo "$sport" >"$STATE/sasl-ssl-port"
    sed -i -e "s|^listeners=\(.*\)|listeners=\1,SASL_SSL://127.0.0.1:$sport|" \
        -e "s|^advertised.listeners=\(.*\)|advertised.listeners=\1,SASL_SSL://127.0.0.1:$sport|" \
        -e "s|^listener.security.protocol.map=\(.*\)|listener.security.protocol.map=\1,SASL_SSL:SASL_SSL|" \
        "$STATE/server.properties"
    cat >>"$STATE/server.properties" <<EOF2
# SASL_SSL listener (TW_KAFKA_SASL_SSL=true): SCRAM users are made at format time, PLAIN users here.
sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512
listener.name.sasl_ssl.ssl.keystore.type=PKCS12
listener.name.sasl_ssl.ssl.keystore.location=$tls/broker.p12
listener.name.sasl_ssl.ssl.keystore.password=$(cat "$tls/keystore.password")
listener.name.sasl_ssl.ssl.key.password=$(cat "$tls/keystore.password")
listener.name.sasl_ssl.ssl.client.auth=none
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_$SASL_USER="$password";
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
EOF2
    chmod 600 "$STATE/server.properties"
}

# Format-time arguments that create the SCRAM users (none without a SASL_SSL listener).
scram_args() {
    [[ -f "$STATE/sasl-ssl-port" ]] || return 0
    local password
    password="$(cat "$STATE/tls/$SASL_USER.password")"
    printf '%s\n' --add-scram "SCRAM-SHA-512=[name=$SASL_USER,password=$password]" \
        --add-scram "SCRAM-SHA-256=[name=$SASL_USER,password=$password]"
}

# The SASL_SSL settings for .env, after TW_KAFKA_BOOTSTRAP (nothing without the listener).
sasl_ssl_env() {
    [[ -f "$STATE/sasl-ssl-port" ]] || return 0
    echo "TW_KAFKA_SASL_SSL_BOOTSTRAP=127.0.0.1:$(cat "$STATE/sasl-ssl-port")"
    echo "TW_KAFKA_SASL_SSL_CAFILE=$STATE/tls/ca.pem"
    echo "TW_KAFKA_SASL_SSL_USERNAME=$SASL_USER"
    echo "TW_KAFKA_SASL_SSL_PASSWORD_FILE=$STATE/tls/$SASL_USER.password"
}

format_storage() {
    local libs="$1" cluster_id scram=()
    [[ -f "$STATE/data/meta.properties" ]] && return 0
    mapfile -t scram < <(scram_args)
    # As Kafka's own Uuid.randomUuid: never an id that starts with "-", which the format tool's
    # argument parser takes for an option (1 id in 64; it failed a fresh CI run once).
    cluster_id="$("$PYTHON" -c '
import base64, uuid
cid = "-"
while cid.startswith("-"):
    cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
print(cid)')"
    [[ -n "$cluster_id" ]] || die "could not make a cluster id with $PYTHON"
    java -Xmx256m -cp "$libs/*" -Dlog4j2.configurationFile="$STATE/log4j2.properties" \
        -Dkafka.logs.dir="$STATE/logs" kafka.tools.StorageTool format \
        --cluster-id "$cluster_id" --config "$STATE/server.properties" "${scram[@]}" >"$STATE/logs/format.log" 2>&1 \
        || { cat "$STATE/logs/format.log" >&2; die "formatting the KRaft log dir failed"; }
}

launch() {
    local libs pid deadline
    libs="$(libs_dir)"
    port_free "$(port)" || die "port $(port) is taken by another process; run 'scripts/kafka.sh down' and 'up' to pick new ports"
    port_free "$(cat "$STATE/controller-port")" || die "controller port $(cat "$STATE/controller-port") is taken; run 'scripts/kafka.sh down' and 'up'"
    [[ ! -f "$STATE/sasl-ssl-port" ]] || port_free "$(cat "$STATE/sasl-ssl-port")" \
        || die "SASL_SSL port $(cat "$STATE/sasl-ssl-port") is taken; run 'scripts/kafka.sh down' and 'up'"
    if [[ -f "$STATE/external-host" ]]; then
        port_free_on "$(cat "$STATE/external-port")" "$(cat "$STATE/external-host")" ||
            die "port $(external) is taken by another process; run 'scripts/kafka.sh down' and 'up' to pick new ports"
    fi
    format_storage "$libs"
    # shellcheck disable=SC2086  # HEAP holds several JVM flags
    setsid nohup java $HEAP -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true \
        -Dlog4j2.configurationFile="$STATE/log4j2.properties" -Dkafka.logs.dir="$STATE/logs" \
        -cp "$libs/*" kafka.Kafka "$STATE/server.properties" \
        >>"$STATE/logs/stdout.log" 2>&1 </dev/null 9>&- &
    pid=$!
    echo "$pid" >"$PID_FILE"
    deadline=$((SECONDS + START_TIMEOUT))
    until healthy; do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 40 "$STATE/logs/server.log" "$STATE/logs/stdout.log" >&2 2>/dev/null || true
            rm -f "$PID_FILE"
            die "the broker exited during start (logs in ${STATE#"$ROOT"/}/logs)"
        fi
        if ((SECONDS >= deadline)); then
            tail -n 40 "$STATE/logs/server.log" >&2 2>/dev/null || true
            die "the broker did not answer on $(bootstrap) within ${START_TIMEOUT}s (pid $pid still running; logs in ${STATE#"$ROOT"/}/logs)"
        fi
        sleep 0.5
    done
    write_env
    log "broker up on $(bootstrap)$(external >/dev/null && echo " and $(external)") (pid $pid)"
}


# TW_LISTEN_HOST asks for an external listener this broker's config lacks: note it (new port).
want_external() {
    local host="$1"
    [[ -n "$host" ]] || return 1
    [[ "$(cat "$STATE/external-host" 2>/dev/null)" == "$host" ]] && return 1
    echo "$host" >"$STATE/external-host.new"
    free_port >"$STATE/external-port.new"
}

cmd_up() {
    local deadline host
    host="$(listen_host)"
    mkdir -p "$STATE"
    if want_external "$host"; then
        if running_pid >/dev/null; then
            log "adding a listener on $(cat "$STATE/external-host.new") (TW_LISTEN_HOST): restarting the broker"
            stop_running 30
        fi
        mv "$STATE/external-host.new" "$STATE/external-host"
        mv "$STATE/external-port.new" "$STATE/external-port"
        [[ -f "$STATE/server.properties" ]] && write_config "$(port)" "$(cat "$STATE/controller-port")"
    fi
    if running_pid >/dev/null; then
        # Running: give a busy or still-starting broker time to answer before replacing it.
        deadline=$((SECONDS + START_TIMEOUT))
        until healthy; do
            if ((SECONDS >= deadline)) || ! running_pid >/dev/null; then break; fi
            sleep 1
        done
        if running_pid >/dev/null && healthy; then
            write_env
            return 0
        fi
        log "the broker (pid $(cat "$PID_FILE" 2>/dev/null)) does not answer: restarting it"
    fi
    need_java_maven
    fetch
    stop_running 30 # a hung or half-started broker of ours
    if [[ -f "$STATE/port" ]] && ! { port_free "$(port)" && port_free "$(cat "$STATE/controller-port")"; }; then
        log "the ports of the stopped broker are taken by another process: starting a new broker"
        rm -f "$STATE/server.properties"
    fi
    if [[ ! -f "$STATE/server.properties" || ! -f "$STATE/port" ]]; then
        # a new broker: keep only the external listener's address asked for (new ports for all)
        find "$STATE" -mindepth 1 -maxdepth 1 ! -name 'external-host' -exec rm -rf {} +
        if [[ -f "$STATE/external-host" ]]; then free_port >"$STATE/external-port"; fi
        local port cport
        port="$(free_port)"
        cport="$(free_port)"
        while [[ "$cport" == "$port" ]]; do cport="$(free_port)"; done
        write_config "$port" "$cport"
        if [[ "$SASL_SSL" == true ]]; then
            local sport
            sport="$(free_port)"
            while [[ "$sport" == "$port" || "$sport" == "$cport" ]]; do sport="$(free_port)"; done
            add_sasl_ssl_listener "$sport"
        fi
    fi
    launch
}

cmd_start() {
    [[ -f "$STATE/server.properties" ]] || die "no stopped broker in ${STATE#"$ROOT"/}: use 'up'"
    cmd_up
}

cmd_down() {
    stop_running 30
    rm -rf "$STATE" "$ENV_FILE"
}

main() {
    local verb="${1:-}"
    mkdir -p "$RUN"
    case "$verb" in
    env)
        [[ -f "$ENV_FILE" ]] || die "no broker started: run 'scripts/kafka.sh up'"
        cat "$ENV_FILE"
        return 0
        ;;
    status)
        running_pid >/dev/null && healthy && { echo "running on $(bootstrap)"; return 0; }
        echo "not running"
        return 1
        ;;
    up | down | start | stop | restart) ;;
    *) die "usage: scripts/kafka.sh up|down|start|stop|restart|status|env" ;;
    esac
    exec 9>"$RUN/$NAME.lock"
    flock 9
    case "$verb" in
    up) cmd_up ;;
    down) cmd_down ;;
    start) cmd_start ;;
    stop) stop_running 30 ;;
    restart)
        [[ -f "$STATE/server.properties" ]] || die "no broker to restart: use 'up'"
        stop_running 30
        cmd_up
        ;;
    esac
}

main "$@"
