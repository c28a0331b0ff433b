#!/usr/bin/env bash
# A local single-node Apache Kafka (KRaft, broker + controller in one JVM) on 127.0.0.1, or a
# cluster of several such nodes (TW_KAFKA_BROKERS, below).
#
#   scripts/kafka.sh up        fetch the broker with Maven (first time), format, start, wait until it answers
#   scripts/kafka.sh down      stop it and delete its data
#   scripts/kafka.sh stop [I]  stop it, keep data and port (`start` or `up` brings the same broker back)
#   scripts/kafka.sh kill [I]  SIGKILL it (no controlled shutdown), keep data and port
#   scripts/kafka.sh start [I] start the stopped broker again (same data, same port)
#   scripts/kafka.sh restart [I]  stop + start: what chaos tests call to bounce the broker mid-run
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
#
# TW_KAFKA_BROKERS=N (1 to 5, default 1; read when the instance is first made, kept after): a KRaft
# cluster of N nodes, each broker and controller (the quorum's voters are all N), on free ports,
# each with its state in .run/<instance>/broker-I/ and TW_KAFKA_HEAP defaulting to 256 MB. With 3
# or more: replication factor 3 and min.insync.replicas 2 for new topics, the offsets and the
# transaction state log; brokers are fenced 6 s after their last heartbeat (the default is 9 s).
# .env's TW_KAFKA_BOOTSTRAP lists every broker in index order (broker I has node.id I). stop, kill,
# start and restart take a broker's index I (1..N) to act on that broker alone; without it they
# act on all. No TW_LISTEN_HOST or SASL_SSL listener for a cluster. E.g. for failover tests:
#   TW_KAFKA_INSTANCE=cluster3 TW_KAFKA_BROKERS=3 scripts/kafka.sh up
#   TW_KAFKA_INSTANCE=cluster3 scripts/kafka.sh kill 2; ...; TW_KAFKA_INSTANCE=cluster3 scripts/kafka.sh start 2
# Every broker aborts a transaction that passed its timeout within about a second
# (transaction.abort.timed.out.transaction.cleanup.interval.ms=1000; Kafka's default is 10 s).
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

# The instance's directory; a cluster's brokers each have theirs below it (node selects one).
INSTANCE="$STATE"
BROKERS="${TW_KAFKA_BROKERS:-}"
[[ -z "$BROKERS" || "$BROKERS" =~ ^[1-5]$ ]] || die "TW_KAFKA_BROKERS must be 1 to 5, got '$BROKERS'"
made_brokers=""
if [[ -f "$INSTANCE/brokers" ]]; then made_brokers="$(cat "$INSTANCE/brokers")"
elif [[ -f "$INSTANCE/server.properties" ]]; then made_brokers=1; fi
if [[ -n "$made_brokers" ]]; then
    [[ -z "$BROKERS" || "$BROKERS" == "$made_brokers" ]] ||
        die "${INSTANCE#"$ROOT"/} was made with $made_brokers broker(s), not TW_KAFKA_BROKERS=$BROKERS: run 'scripts/kafka.sh down' first"
    BROKERS="$made_brokers"
fi
BROKERS="${BROKERS:-1}"
if ((BROKERS > 1)); then
    [[ "$SASL_SSL" == false ]] || die "TW_KAFKA_SASL_SSL=true is for a single broker, not TW_KAFKA_BROKERS=$BROKERS"
    [[ -z "${TW_LISTEN_HOST:-}" ]] || die "TW_LISTEN_HOST is for a single broker, not TW_KAFKA_BROKERS=$BROKERS"
fi
#: Replication of new topics, the offsets and the transaction state log, and the ISR writes need.
RF=$((BROKERS < 3 ? BROKERS : 3))
MIN_ISR=$((RF >= 3 ? 2 : 1))

POM="$ROOT/scripts/kafka/pom.xml"
if ((BROKERS > 1)); then HEAP="${TW_KAFKA_HEAP:--Xmx256m -Xms256m}"; else HEAP="${TW_KAFKA_HEAP:--Xmx512m -Xms512m}"; fi
START_TIMEOUT="${TW_KAFKA_START_TIMEOUT:-120}"

# The state directory of broker $1 (1..BROKERS): the instance's own for a single broker.
node_dir() { if ((BROKERS == 1)); then echo "$INSTANCE"; else echo "$INSTANCE/broker-$1"; fi; }

# Select broker $1: STATE, PID_FILE and NODE_ID name it for the functions below.
NODE_ID=1
node() {
    NODE_ID="$1"
    STATE="$(node_dir "$1")"
    PID_FILE="$STATE/$NAME.pid"
}

# The brokers' indexes, 1..BROKERS.
nodes() { seq 1 "$BROKERS"; }

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

# The selected broker's address.
bootstrap() { echo "127.0.0.1:$(port)"; }

# Every broker's address, in index order, comma-separated (what clients bootstrap from).
all_bootstrap() {
    local i out=""
    for i in $(nodes); do out+="${out:+,}127.0.0.1:$(cat "$(node_dir "$i")/port")"; done
    echo "$out"
}

# The selected broker answers metadata requests and lists itself, registered and unfenced.
healthy() {
    local addr
    addr="$(bootstrap)"
    if "$PYTHON" -c 'import kafka' 2>/dev/null; then
        "$PYTHON" - "$addr" "$NODE_ID" <<'EOF' >/dev/null 2>&1
import sys
from kafka import KafkaAdminClient
admin = KafkaAdminClient(bootstrap_servers=sys.argv[1], request_timeout_ms=3000, bootstrap_timeout_ms=3000)
try:
    brokers = admin.describe_cluster().get("brokers") or []
    sys.exit(0 if any(b.get("broker_id") == int(sys.argv[2]) and not b.get("is_fenced") for b in brokers) else 1)
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
    echo "TW_KAFKA_BOOTSTRAP=$(all_bootstrap)" >"$ENV_FILE"
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
# Generated by scripts/kafka.sh: node $NODE_ID of a $BROKERS-node KRaft cluster (broker and controller) for development and tests.
process.roles=broker,controller
node.id=$NODE_ID
controller.quorum.voters=$(voters)
listeners=$listeners
advertised.listeners=$advertised
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=$protocols
log.dirs=$STATE/data
num.partitions=1
default.replication.factor=$RF
min.insync.replicas=$MIN_ISR
auto.create.topics.enable=$AUTO_CREATE
offsets.topic.replication.factor=$RF
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=$RF
transaction.state.log.min.isr=$MIN_ISR
transaction.state.log.num.partitions=4
# A transaction past its timeout (a zombie producer's) is aborted within about a second of it.
transaction.abort.timed.out.transaction.cleanup.interval.ms=1000
share.coordinator.state.topic.replication.factor=$RF
share.coordinator.state.topic.min.isr=$MIN_ISR
group.initial.rebalance.delay.ms=0
num.network.threads=$((BROKERS > 1 ? 1 : 2))
num.io.threads=$((BROKERS > 1 ? 2 : 4))
log.retention.hours=168
log.segment.bytes=268435456
log.retention.check.interval.ms=60000
# Tests drive time with a simulated clock that may stamp records months ahead: accept them
# (Kafka 4 rejects timestamps more than one hour in the future by default).
log.message.timestamp.after.max.ms=9223372036854775807
EOF
    if ((BROKERS > 1)); then
        cat >>"$STATE/server.properties" <<EOF
# A killed broker is fenced, and leaves the ISRs, 6 s after its last heartbeat (defaults 2 s, 9 s).
broker.heartbeat.interval.ms=1000
broker.session.timeout.ms=6000
EOF
    fi
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

# The controller quorum: every node, by its index and controller port.
voters() {
    local i out=""
    for i in $(nodes); do out+="${out:+,}$i@127.0.0.1:$(cat "$(node_dir "$i")/controller-port")"; done
    echo "$out"
}

# The instance's cluster id, made once (every node of a cluster is formatted with it).
cluster_id() {
    if [[ ! -s "$INSTANCE/cluster-id" ]]; then
        # As Kafka's own Uuid.randomUuid: never an id that starts with "-", which the format tool's
        # argument parser takes for an option (1 id in 64; it failed a fresh CI run once).
        "$PYTHON" -c '
import base64, uuid
cid = "-"
while cid.startswith("-"):
    cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
print(cid)' >"$INSTANCE/cluster-id" || true
    fi
    cat "$INSTANCE/cluster-id"
}

format_storage() {
    local libs="$1" cluster_id scram=()
    [[ -f "$STATE/data/meta.properties" ]] && return 0
    mapfile -t scram < <(scram_args)
    cluster_id="$(cluster_id)"
    [[ -n "$cluster_id" ]] || die "could not make a cluster id with $PYTHON"
    java -Xmx256m -cp "$libs/*" -Dlog4j2.configurationFile="$STATE/log4j2.properties" \
        -Dkafka.logs.dir="$STATE/logs" kafka.tools.StorageTool format \
        --cluster-id "$cluster_id" --config "$STATE/server.properties" "${scram[@]}" >"$STATE/logs/format.log" 2>&1 \
        || { cat "$STATE/logs/format.log" >&2; die "formatting the KRaft log dir failed"; }
}

# Start the selected broker's JVM (its pid in PID_FILE); await_up waits until it answers.
spawn() {
    local libs
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
    echo "$!" >"$PID_FILE"
}

await_up() {
    local pid deadline
    pid="$(cat "$PID_FILE")"
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
}

launch() {
    spawn
    await_up
    write_env
    log "broker up on $(bootstrap)$(external >/dev/null && echo " and $(external)") (pid $(cat "$PID_FILE"))"
}

# Stop the selected broker: TERM, KILL after 30 s (common.sh).
stop_broker() { stop_running 30; }

# SIGKILL the selected broker, as a crash of its machine would end it; wait until it is gone.
kill_broker() {
    local pid
    pid="$(running_pid)" || { rm -f "$PID_FILE"; return 0; }
    kill -KILL "$pid" 2>/dev/null || true
    while running_pid >/dev/null; do sleep 0.05; done
    rm -f "$PID_FILE"
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
            stop_broker
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
    stop_broker # a hung or half-started broker of ours
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
        echo 1 >"$STATE/brokers"
        if [[ "$SASL_SSL" == true ]]; then
            local sport
            sport="$(free_port)"
            while [[ "$sport" == "$port" || "$sport" == "$cport" ]]; do sport="$(free_port)"; done
            add_sasl_ssl_listener "$sport"
        fi
    fi
    launch
}

cmd_up_all() { if ((BROKERS > 1)); then cluster_up; else cmd_up; fi; }

# --- a cluster (TW_KAFKA_BROKERS > 1) ---------------------------------------------------------------

# New ports, configs and a cluster id for every node; data formatted at their first start.
make_cluster() {
    local i used=" " p
    rm -rf "$INSTANCE"
    mkdir -p "$INSTANCE"
    for i in $(nodes); do
        mkdir -p "$(node_dir "$i")"
        for p in port controller-port; do
            local free
            free="$(free_port)"
            while [[ "$used" == *" $free "* ]]; do free="$(free_port)"; done
            used+="$free "
            echo "$free" >"$(node_dir "$i")/$p"
        done
    done
    for i in $(nodes); do
        node "$i"
        write_config "$(port)" "$(cat "$STATE/controller-port")"
    done
    echo "$BROKERS" >"$INSTANCE/brokers"
}

# Every node running and answering.
cluster_healthy() {
    local i
    for i in $(nodes); do
        node "$i"
        running_pid >/dev/null && healthy || return 1
    done
}

# Start the nodes that are not running (the quorum forms only once most of them run), then wait
# for each.
cluster_up() {
    local i
    if [[ -f "$INSTANCE/brokers" ]] && cluster_healthy; then
        write_env
        return 0
    fi
    need_java_maven
    fetch
    [[ -f "$INSTANCE/brokers" ]] || make_cluster
    for i in $(nodes); do
        node "$i"
        running_pid >/dev/null || spawn
    done
    for i in $(nodes); do
        node "$i"
        await_up
    done
    write_env
    log "$BROKERS brokers up on $(all_bootstrap)"
}

# Start broker $1 of a made instance again and wait until it answers.
start_one() {
    node "$1"
    [[ -f "$STATE/server.properties" ]] || die "no stopped broker $1 in ${STATE#"$ROOT"/}: use 'up'"
    if ! running_pid >/dev/null; then
        need_java_maven
        fetch
        spawn
    fi
    await_up
    write_env
    log "broker $1 up on $(bootstrap) (pid $(cat "$PID_FILE"))"
}

each_node() {
    local i
    for i in $(nodes); do
        node "$i"
        "$@"
    done
}

# Stop every broker: TERM to all at once (one by one, the last would wait for a quorum that
# is gone), then wait for each.
stop_all() {
    local i pid
    for i in $(nodes); do
        node "$i"
        if pid="$(running_pid)"; then kill -TERM "$pid" 2>/dev/null || true; fi
    done
    each_node stop_broker
}

cmd_down() {
    # Its data goes too: no need for a controlled shutdown.
    if ((BROKERS > 1)); then each_node kill_broker; else stop_broker; fi
    rm -rf "$INSTANCE" "$ENV_FILE"
}

main() {
    local verb="${1:-}" index="${2:-}"
    mkdir -p "$RUN"
    case "$verb" in
    env)
        [[ -f "$ENV_FILE" ]] || die "no broker started: run 'scripts/kafka.sh up'"
        cat "$ENV_FILE"
        return 0
        ;;
    status)
        [[ -f "$(node_dir 1)/port" ]] && cluster_healthy && { echo "running on $(all_bootstrap)"; return 0; }
        echo "not running"
        return 1
        ;;
    up | down) ;;
    start | stop | kill | restart)
        [[ -z "$index" || ("$index" =~ ^[1-9]$ && "$index" -le "$BROKERS") ]] ||
            die "$verb: no broker $index in ${INSTANCE#"$ROOT"/} (brokers 1..$BROKERS)"
        ;;
    *) die "usage: scripts/kafka.sh up|down|start [I]|stop [I]|kill [I]|restart [I]|status|env" ;;
    esac
    exec 9>"$RUN/$NAME.lock"
    flock 9
    if [[ -n "$index" ]]; then
        case "$verb" in
        start) start_one "$index" ;;
        stop) node "$index"; stop_broker ;;
        kill) node "$index"; kill_broker ;;
        restart) node "$index"; stop_broker; start_one "$index" ;;
        esac
        return 0
    fi
    case "$verb" in
    kill) each_node kill_broker ;;
    stop) stop_all ;;
    down) cmd_down ;;
    up) cmd_up_all ;;
    start)
        [[ -f "$(node_dir 1)/server.properties" ]] || die "no stopped broker in ${INSTANCE#"$ROOT"/}: use 'up'"
        cmd_up_all
        ;;
    restart)
        [[ -f "$(node_dir 1)/server.properties" ]] || die "no broker to restart: use 'up'"
        stop_all
        cmd_up_all
        ;;
    esac
}

main "$@"
