"""The chart on the real local cluster (scripts/k8s.sh), end to end, as a user runs it on a cluster
that is not ours:

    make image -> skopeo copy to a registry that wants a password (scripts/registry.sh) ->
    helm install tw charts/timerwheel (image.repository: that registry, pullPolicy Always,
      imagePullSecrets; the default ReadWriteOnce claim; the stage pods placed by spec.pods;
      Kafka and Redis on the host)
      -> the TimerWheel is Ready: five stage pods on one volume claim (a hostPath PV), all on the
         claim's node, pulled with the pull secret
      -> the first message the install's notes print is delivered where they say
      -> a plain kafka-python producer (harness.TimerProducer) schedules with the wire contract:
         random delays, cancels, rolled messages, invalid ones -> delivered once, not early;
         cancelled ones not delivered; invalid ones dead-lettered
      -> one trace per message joins the five stage pods (OTLP to a receiver in this test)
      -> helm test passes and leaves nothing -> the API server refuses a bad TimerWheel naming
         the field -> TimerWheels whose image cannot be pulled, whose claim stays Pending or
         whose stage crash-loops say so in Degraded and an Event
      -> Ready follows a stage's pod within seconds (the operator watches the pods)
      -> lateness at 200 msg/s for 60 s (a figure, printed) -> deleting stage pods under load
         loses nothing -> helm uninstall keeps the CRD and the claim

The tests of this module share one release and run in file order. Figures (install to Ready,
lateness) are printed as ``FIGURE`` lines, never asserted: the machine is shared.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shlex
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from harness import Collector, LoadRun, Pipeline, Scheduled, TimerProducer, make_report, now_ms, with_db
from k8s_cluster import ROOT, Cluster, Registry, write_values
from otlp_receiver import OtlpReceiver, SpanRec
from test_tracing import message_trace
from timerwheel.store.layout import shard_dir

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]

RELEASE = "tw"
NAMESPACE = "timers"
WHEEL = RELEASE  # the chart names the TimerWheel after the release
CLAIM = f"timerwheel-{WHEEL}-data"
SHARDS = 2  # test_tracing.message_trace assumes 2 shards and a 100 ms tick
TICK_MS = 100
ROLL_WINDOW_MS = 10_000  # small: a 25 s delay is rolled
STAGES = ("enqueue-get", "enqueue-put", "dequeue-get", "dequeue-getmsg", "dequeue-put")
#: How late the TimerWheel's Ready may follow a stage pod: half the operator's level period (10 s).
READY_LAG_S = 5.0


def _script_env(script: str, env: dict[str, str]) -> dict[str, str]:
    done = subprocess.run([str(ROOT / "scripts" / script), "up"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, check=False, env={**os.environ, **env})
    if done.returncode != 0:
        pytest.fail(f"scripts/{script} up with TW_LISTEN_HOST failed:\n{done.stderr[-2000:]}", pytrace=False)
    out = subprocess.run([str(ROOT / "scripts" / script), "env"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def helm_binary() -> str:
    out = subprocess.run([str(ROOT / "scripts" / "helm.sh"), "path"], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        pytest.fail(f"scripts/helm.sh could not build helm (needs Go and the Go module proxy):\n{out.stderr[-2000:]}",
                    pytrace=False)
    return out.stdout.strip().splitlines()[-1]


@dataclass
class Release:
    k8s: Cluster
    helm_bin: str
    pipe: Pipeline  # topics, allow-list and Redis DB of this run; its stage processes never start
    kafka_pods: str  # Kafka and Redis as the pods reach them
    redis_pods: str
    receiver: OtlpReceiver
    volume_dir: Path
    values: dict[str, Any]
    registry: Registry
    node: str
    install_to_ready_s: float = float("nan")
    #: what `helm install` printed (its notes)
    notes: str = ""

    def helm(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.helm_bin, "--kubeconfig", self.k8s.kubeconfig, *args], capture_output=True,
                              text=True, timeout=timeout, check=False)

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.k8s.kubectl("-n", NAMESPACE, *args, **kw)

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def pods(self, component: str | None = None) -> list[dict[str, Any]]:
        sel = f"app.kubernetes.io/instance={WHEEL},app.kubernetes.io/part-of=timerwheel"
        if component:
            sel += f",app.kubernetes.io/component={component}"
        items: list[dict[str, Any]] = self.get("pods", "-l", sel)["items"]
        return [p for p in items if component is not None or p["metadata"]["labels"].get(
            "app.kubernetes.io/component") in STAGES]

    def ready_pod(self, stage: str) -> dict[str, Any] | None:
        for p in self.pods(stage):
            conds = {c["type"]: c["status"] for c in p["status"].get("conditions", [])}
            if p["status"].get("phase") == "Running" and conds.get("Ready") == "True" \
                    and not p["metadata"].get("deletionTimestamp"):
                return p
        return None

    def diagnosis(self) -> str:
        """What to read when something is wrong: the TimerWheel, the pods, the ends of their logs."""
        out = [self.kubectl("get", "timerwheel,pods,pvc", "-o", "wide", check=False).stdout]
        tw = self.kubectl("get", "timerwheel", WHEEL, "-o", "json", check=False)
        if tw.returncode == 0:
            out.append(json.dumps(json.loads(tw.stdout).get("status"), indent=1)[-3000:])
        pods = self.kubectl("get", "pods", "-o", "name", check=False).stdout.split()
        for name in pods:
            out.append(f"--- {name}\n" + self.kubectl("logs", name, "--tail=15", check=False).stdout[-2500:])
        return "\n".join(out)


#: The pull secret of the registry (scripts/registry.sh wants a password).
PULL_SECRET = "tw-e2e-registry"


def wheel_values(pipe: Pipeline, kafka: str, redis_url: str, otlp: str, storage_class: str, registry: Registry,
                 node: str) -> dict[str, Any]:
    return {
        "image": {"repository": registry.repository, "tag": registry.tag, "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": PULL_SECRET}],
        "timerwheel": {"spec": {
            "shards": SHARDS,
            "tickMs": TICK_MS,
            "rollWindowMs": ROLL_WINDOW_MS,
            "wheelSpanMs": 4 * ROLL_WINDOW_MS,
            "maxDelayMs": 3_600_000,
            "timerTopic": pipe.timer_topic,
            "dlqTopic": pipe.dlq_topic,
            "timerPartitions": 4,
            "allowTopics": [str(pipe.settings["allow_topics"])],
            "kafka": {"bootstrap": kafka},
            "redis": {"url": redis_url},
            # the default access modes: ReadWriteOnce
            "storage": {"storageClassName": storage_class, "size": "1Gi"},
            "tracing": {"otlpEndpoint": otlp},
            "pods": {"annotations": {"timerwheel.io/e2e": pipe.uid}, "priorityClassName": storage_class,
                     "nodeSelector": {"kubernetes.io/hostname": node},
                     "tolerations": [{"key": "timerwheel.io/e2e", "operator": "Exists", "effect": "NoSchedule"}]},
        }},
        "tests": {"topic": pipe.dest("helm-test"), "delayMs": 2000, "timeoutSeconds": 120},
    }


@pytest.fixture(scope="module")
def release(k8s: Cluster, registry: Registry, kafka_control: Any, redis_control: Any, kafka_bootstrap: str,
            redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    if not (kafka_control.managed and redis_control.managed):
        pytest.fail("the chart's pods need Kafka and Redis on an address they reach: only the servers "
                    "scripts/kafka.sh and scripts/redis.sh start can be asked to listen there (TW_LISTEN_HOST); "
                    "unset TW_KAFKA_BOOTSTRAP / TW_REDIS_URL", pytrace=False)
    listen = {"TW_LISTEN_HOST": k8s.host_ip}
    redis_ext = _script_env("redis.sh", listen)["TW_REDIS_EXTERNAL_URL"]
    kafka_ext = _script_env("kafka.sh", listen)["TW_KAFKA_EXTERNAL_BOOTSTRAP"]
    pipe = Pipeline(tmp_path_factory.mktemp("k8s-helm"), kafka_bootstrap, redis_url, shards=SHARDS, tick_ms=TICK_MS,
                    roll_window_ms=ROLL_WINDOW_MS)
    pipe.create_timer_topic()
    pipe.create_topic(pipe.dlq_topic, 1)
    db = int(pipe.redis_url.rstrip("/").rsplit("/", 1)[1])
    receiver = OtlpReceiver(host=k8s.host_ip).start()
    # The volume: a hostPath PV of a class of its own, pre-bound to the claim the operator makes.
    storage_class = f"tw-e2e-{pipe.uid}"
    volume_dir = ROOT / ".run" / "k8s" / "volumes" / storage_class
    volume_dir.mkdir(parents=True)
    os.chown(volume_dir, 10001, 10001)  # the image's user; fsGroup does not apply to hostPath
    node = k8s.get("nodes")["items"][0]["metadata"]["name"]
    rel = Release(k8s, helm_binary(), pipe, kafka_ext, with_db(redis_ext, db), receiver, volume_dir,
                  wheel_values(pipe, kafka_ext, with_db(redis_ext, db), receiver.endpoint, storage_class, registry,
                               node), registry, node)
    # The namespace with the registry's pull secret, and the stages' PriorityClass (of the PV's name).
    k8s.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
              registry.pull_secret(PULL_SECRET, NAMESPACE),
              {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "value": 1000,
               "metadata": {"name": storage_class, "labels": {"app.kubernetes.io/part-of": "tw-e2e"}}})
    # A ReadWriteOnce volume only, as every cluster's default storage class offers.
    k8s.apply({"apiVersion": "v1", "kind": "PersistentVolume",
               "metadata": {"name": storage_class, "labels": {"app.kubernetes.io/part-of": "tw-e2e"}},
               "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                        "persistentVolumeReclaimPolicy": "Retain", "storageClassName": storage_class,
                        "claimRef": {"namespace": NAMESPACE, "name": CLAIM},
                        "hostPath": {"path": str(volume_dir), "type": "Directory"}}})
    try:
        yield rel
    finally:
        if rel.helm("status", RELEASE, "-n", NAMESPACE).returncode == 0:
            rel.helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "120s")
        # A TimerWheel a failed test left behind must not hold the namespace (no operator runs now).
        for name in k8s.kubectl("-n", NAMESPACE, "get", "timerwheel", "-o", "name", check=False).stdout.split():
            k8s.kubectl("-n", NAMESPACE, "patch", name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                        check=False)
        k8s.kubectl("delete", "namespace", NAMESPACE, "--wait=true", "--timeout=120s", check=False, timeout=180)
        k8s.kubectl("delete", "pv,priorityclass", storage_class, "--wait=false", check=False)
        receiver.close()
        pipe.stop_all()


def test_helm_install_makes_a_ready_timerwheel_of_five_stage_pods_on_one_claim(release: Release,
                                                                               tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    write_values(values, release.values)
    t0 = time.monotonic()
    done = release.helm("install", RELEASE, str(ROOT / "charts" / "timerwheel"), "-n", NAMESPACE,
                        "--create-namespace", "-f", str(values), "--wait", "--timeout", "300s")
    assert done.returncode == 0, done.stderr + release.diagnosis()
    release.notes = done.stdout
    waited = release.kubectl("wait", f"timerwheel/{WHEEL}", "--for=condition=Ready", "--timeout=300s",
                             check=False, timeout=330)
    release.install_to_ready_s = time.monotonic() - t0
    assert waited.returncode == 0, waited.stderr + release.diagnosis()
    print(f"FIGURE helm install -> TimerWheel Ready: {release.install_to_ready_s:.1f} s", flush=True)

    tw = release.get("timerwheel", WHEEL)
    conditions = {c["type"]: c for c in tw["status"]["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Degraded"]["status"] == "False", conditions["Degraded"]
    assert tw["status"]["observedGeneration"] == tw["metadata"]["generation"]
    pods = release.pods()
    assert sorted(p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods) == sorted(STAGES), \
        [p["metadata"]["name"] for p in pods]
    image = f"{release.registry.repository}:{release.registry.tag}"
    for p in pods:
        name, spec = p["metadata"]["name"], p["spec"]
        assert p["status"]["phase"] == "Running", name
        # pulled from the registry with the chart's pull secret (it wants a password)
        assert spec["containers"][0]["image"] == image and spec["containers"][0]["imagePullPolicy"] == "Always"
        assert spec["imagePullSecrets"] == [{"name": PULL_SECRET}], name
        assert p["status"]["containerStatuses"][0]["imageID"].startswith(f"{release.registry.repository}@sha256:")
        claims = [v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v]
        assert claims == [CLAIM], (name, claims)
        # placed as spec.pods says, and kept on the ReadWriteOnce claim's node
        assert p["metadata"]["annotations"]["timerwheel.io/e2e"] == release.pipe.uid, name
        assert spec["priorityClassName"] == f"tw-e2e-{release.pipe.uid}" and spec["priority"] == 1000, name
        assert spec["nodeSelector"] == {"kubernetes.io/hostname": release.node}, name
        assert {"key": "timerwheel.io/e2e", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0][
            "topologyKey"] == "kubernetes.io/hostname", name
        assert spec["nodeName"] == release.node, name
    pvc = release.get("pvc", CLAIM)
    assert pvc["status"]["phase"] == "Bound" and pvc["spec"]["volumeName"] == f"tw-e2e-{release.pipe.uid}"
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]  # the default
    # The stages write the shards on the one volume: the hostPath directory has them.
    shards = sorted(p.name for p in release.volume_dir.iterdir() if p.name.startswith("shard-"))
    assert shards == [os.path.basename(shard_dir(release.volume_dir, s)) for s in range(SHARDS)], sorted(os.listdir(release.volume_dir))
    # and each shard is owned by the StatefulSets' pods (status from the stages' /metrics)
    owners = {s["shard"]: (s.get("owner", ""), s.get("reader", "")) for s in tw["status"].get("shards", [])}
    assert sorted(owners) == list(range(SHARDS)), tw["status"]
    for owner, reader in owners.values():
        assert owner.startswith(f"timerwheel-{WHEEL}-enqueue-put-"), owners
        assert reader.startswith(f"timerwheel-{WHEEL}-dequeue-get-"), owners


def _traceparent(rng: random.Random) -> tuple[int, int, str]:
    trace_id, span_id = rng.getrandbits(128) or 1, rng.getrandbits(64) or 1
    return trace_id, span_id, f"00-{trace_id:032x}-{span_id:016x}-01"


def rolled_trace(m: Scheduled, send: SpanRec, delivered_tp: str, consumer: SpanRec, spans: list[SpanRec],
                 timer_topic: str, dest: str) -> list[str]:
    """What is missing in the trace of a rolled message, hop by hop. The first hop is the
    enqueue-get, enqueue-put, dequeue-getmsg and dequeue-put spans linking the send span; its
    dequeue-put span is the roll, ``send <timer topic>``, a batch span whose context rides in
    every record it rolled. The next hop's spans link that context (one link per context: the
    messages rolled together share their later spans), and so on until a dequeue-put span that
    links the previous hop is the delivery span the delivered record's traceparent names, which
    the consumer continues: one trace from the send to the consumer through the five pods."""
    p: list[str] = []
    _v, trace_hex, span_hex, _f = delivered_tp.split("-")
    delivered = (int(trace_hex, 16), int(span_hex, 16))
    frontier: list[SpanRec] = [send]
    for hop in range(1, 6):
        linking = [s for s in spans if any(s.links_to(at.trace_id, at.span_id) for at in frontier)]
        stages = sorted(str(s.resource.get("timerwheel.stage")) for s in linking)
        if hop == 1 and stages != ["dequeue-getmsg", "dequeue-put", "enqueue-get", "enqueue-put"]:
            p.append(f"{m.message_id}: stages {stages} link the send span")
        if not {"enqueue-get", "enqueue-put", "dequeue-getmsg", "dequeue-put"} <= set(stages):
            p.append(f"{m.message_id} hop {hop}: only stages {sorted(set(stages))} link the previous hop")
            return p
        ends = [s for s in linking if s.resource.get("timerwheel.stage") == "dequeue-put"]
        if delivered in {(s.trace_id, s.span_id) for s in ends}:
            if hop == 1:
                p.append(f"{m.message_id}: delivered without a roll")
            if (consumer.trace_id, consumer.parent_span_id) != delivered:
                p.append(f"{m.message_id}: the consumer does not continue the delivery span")
            return p
        # the roll: `send <timer topic>`, or plain `send` when the batch also delivered
        frontier = [s for s in ends if s.name in (f"send {timer_topic}", "send")]
        if not frontier:
            p.append(f"{m.message_id} hop {hop}: dequeue-put spans {[s.name for s in ends]}: neither a roll nor "
                     f"the delivery to {dest}")
            return p
    p.append(f"{m.message_id}: not delivered within 5 hops")
    return p


def test_the_wire_contract_through_the_pods_with_one_trace_per_message(release: Release) -> None:
    pipe = release.pipe
    dest = pipe.new_dest("wire", 2)
    rng = random.Random(13)
    sends: dict[str, SpanRec] = {}

    def send_span(m: Scheduled, trace_id: int, span_id: int) -> None:
        sends[m.message_id] = SpanRec(f"send {pipe.timer_topic}", "PRODUCER", trace_id, span_id, None, {}, (), (),
                                      "UNSET", {})

    with TimerProducer(pipe, seed=13) as producer, Collector(pipe, [dest]) as collector, \
            Collector(pipe, [pipe.dlq_topic]) as dlq:
        t0 = now_ms()
        kept: list[Scheduled] = []
        for i in range(24):  # random delays, half within the 10 s roll window, half rolled (12 s to 30 s)
            tid, sid, tp = _traceparent(rng)
            delay = rng.randint(3_000, 8_000) if i % 2 else rng.randint(12_000, 30_000)
            m = producer.schedule(dest, t0 + delay, headers=[("traceparent", tp.encode())])
            send_span(m, tid, sid)
            kept.append(m)
        rolled = producer.schedule(dest, delay_ms=25_000)  # tw-delay-ms, 2.5 roll windows ahead
        doomed = [producer.schedule(dest, t0 + d) for d in (4_000, 12_000, 26_000)]  # the last two rolled
        producer.flush()
        for m in doomed:
            producer.cancel(m)
        invalid = {
            "not allowed": [("tw-topic", b"forbidden-topic"), ("tw-delay-ms", b"2000")],
            "bad delay": [("tw-topic", dest.encode()), ("tw-delay-ms", b"soon")],
            "too far": [("tw-topic", dest.encode()), ("tw-delay-ms", str(7_200_000).encode())],
        }
        invalid_ids = {}
        for reason, headers in invalid.items():
            mid = f"invalid-{uuid.uuid4().hex}"
            invalid_ids[mid] = reason
            producer.send_raw([*headers, ("tw-id", mid.encode())], mid.encode(), b"x")
        producer.flush()
        expected = producer.expected()
        assert len(expected) == len(kept) + 1, "the producer's records were not all acknowledged"

        missing = collector.wait_for(expected, 90)
        dead_missing = dlq.wait_for(invalid_ids, 30)
        time.sleep(3)  # a cancelled message or a second copy would show now
        rep = make_report("k8s wire contract", producer, collector)
        assert not missing, f"not delivered: {sorted(missing)}\n{rep.line()}\n{release.diagnosis()}"
        assert rep.lost == [] and rep.early == rep.early_received == [] and rep.duplicated == 0, rep.line()
        assert rep.cancelled_delivered == [] and rep.unexpected == [], rep.line()
        assert {m.message_id for m in doomed}.isdisjoint(collector.delivered_ids())
        assert rolled.message_id in collector.delivered_ids()
        assert not dead_missing, f"not dead-lettered: {[invalid_ids[m] for m in dead_missing]}"
        for mid in invalid_ids:
            (d,) = dlq.by_id[mid]
            assert d.headers.get("tw-error"), d.headers
        assert set(dlq.delivered_ids()) == set(invalid_ids), dlq.delivered_ids()
        assert invalid_ids.keys().isdisjoint(collector.delivered_ids())

        # One trace per message across the five pods: the stages' spans link the producer's
        # traceparent; the delivered record's traceparent is dequeue-put's span.
        delivered_tp = {m.message_id: collector.by_id[m.message_id][0].headers["traceparent"].decode()
                        for m in kept}
        consumers = {}
        for mid, tp in delivered_tp.items():
            _v, trace_hex, span_hex, _f = tp.split("-")
            consumers[mid] = SpanRec(f"process {dest}", "CONSUMER", int(trace_hex, 16), rng.getrandbits(64),
                                     int(span_hex, 16), {}, (), (), "UNSET", {})

        def problems() -> list[str]:
            spans = release.receiver.spans()
            out: list[str] = []
            for m in kept:
                if m.deliver_at_ms - m.sent_ms < ROLL_WINDOW_MS:
                    out += message_trace(m, sends[m.message_id], delivered_tp[m.message_id],  # type: ignore[arg-type]
                                         consumers[m.message_id], spans, pipe.timer_topic, dest)
                else:
                    out += rolled_trace(m, sends[m.message_id], delivered_tp[m.message_id], consumers[m.message_id],
                                        spans, pipe.timer_topic, dest)
            stages_seen = {s.resource.get("timerwheel.stage") for s in spans}
            if not set(STAGES) <= stages_seen:
                out.append(f"spans from stages {sorted(map(str, stages_seen))} only")
            return out

        release.receiver.wait(lambda: not problems(), 30)
        found = problems()
        assert not found, "\n".join(found[:30]) + f"\n{len(release.receiver.spans())} spans received"
        assert release.receiver.bad_requests == []


def _delivered(release: Release, topic: str, message_id: str | None, prefix: str = "", timeout_s: float = 90,
               value: bytes | None = None) -> dict[str, bytes]:
    """The headers of the record with tw-id ``message_id`` (or the first whose tw-id starts with
    ``prefix``, or whose value is ``value``) on ``topic``, read from its start; fails after ``timeout_s``."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, bootstrap_servers=release.pipe.kafka, auto_offset_reset="earliest",
                             enable_auto_commit=False, group_id=None, consumer_timeout_ms=1000)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=1000).values():
                for rec in batch:
                    headers = dict(rec.headers or [])
                    mid = headers.get("tw-id", b"").decode()
                    if mid == message_id or (prefix and mid.startswith(prefix)) or (value is not None and rec.value == value):
                        return {**headers, "value": rec.value}
    finally:
        consumer.close()
    pytest.fail(f"no record tw-id={message_id or prefix + '*'} (value {value!r}) on {topic} within {timeout_s:.0f} s\n"
                f"{release.diagnosis()}", pytrace=False)


def test_the_first_message_the_notes_print_is_delivered_where_they_say(release: Release) -> None:
    """The notes' command, run as printed: the timer topic the TimerWheel reads, a destination its
    allow-list allows, the image pulled from the registry with the pull secret."""
    lines = release.notes.replace("\\\n", " ").splitlines()
    (command,) = [x.strip() for x in lines if "run tw-hello" in x]
    words = shlex.split(command)
    assert words[0] == "kubectl" and words[words.index("--timer-topic") + 1] == release.pipe.timer_topic, words
    dest = words[words.index("--topic") + 1]
    assert dest == release.values["tests"]["topic"], words
    done = release.k8s.kubectl(*words[1:], timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr + release.diagnosis()
    ticket = next((w for w in done.stdout.split() if w.startswith("tw1.")), None)
    if ticket is not None:
        found = _delivered(release, dest, ticket.split(".", 3)[3])
    else:
        # `kubectl run -i` may attach after a short-lived container has ended and print nothing
        # of its output (exit 0 all the same): the pod wrote the message, find it by its value.
        found = _delivered(release, dest, None, value=b"hello")
    assert found["value"] == b"hello" and "tw-delivered-at" in found
    assert f"--topic {dest} --follow" in release.notes  # and the notes say where to read it


def test_helm_test_passes_and_leaves_nothing_behind(release: Release) -> None:
    # (not --logs: helm reads the logs of a pod named after the hook, and the hook is a Job)
    done = release.helm("test", RELEASE, "-n", NAMESPACE, "--timeout", "300s", timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + release.diagnosis()
    assert "Phase:          Succeeded" in done.stdout, done.stdout
    # what it scheduled was delivered (its Job exits 0 only then) ...
    found = _delivered(release, release.values["tests"]["topic"], None, prefix="helm-test-")
    assert found["value"] == b"helm test" and "tw-delivered-at" in found
    # ... and helm deleted the Job and its pod: `helm uninstall` never deletes hooks
    deadline = time.monotonic() + 60
    while release.kubectl("get", "jobs,pods", "-l", "app.kubernetes.io/component=test", "-o", "name").stdout.strip():
        assert time.monotonic() < deadline, release.kubectl("get", "jobs,pods", "-l",
                                                             "app.kubernetes.io/component=test").stdout
        time.sleep(1)


def _apply_refused(release: Release, body: dict[str, Any]) -> str:
    done = release.kubectl("apply", "-f", "-", input=json.dumps(body), check=False)
    assert done.returncode == 1, f"kubectl apply accepted it (exit {done.returncode}): {done.stdout}"
    return done.stderr


def test_the_api_server_refuses_a_bad_timerwheel_naming_the_field(release: Release) -> None:
    spec = {"kafka": {"bootstrap": release.kafka_pods}, "redis": {"url": release.redis_pods}}
    bad = {"apiVersion": "timerwheel.io/v1alpha1", "kind": "TimerWheel",
           "metadata": {"name": "bad", "namespace": NAMESPACE}, "spec": {**spec, "tickMs": 7}}
    err = _apply_refused(release, bad)
    assert 'The TimerWheel "bad" is invalid' in err and "spec.tickMs" in err and 'Unsupported value: 7' in err, err
    bad["spec"] = {**spec, "tickMs": 100, "rollWindowMs": 10_000, "wheelSpanMs": 15_000}
    err = _apply_refused(release, bad)
    assert "spec.wheelSpanMs" in err, err
    assert release.kubectl("get", "timerwheel", "bad", check=False).returncode == 1  # nothing was made

    live = release.get("timerwheel", WHEEL)
    changed = {"apiVersion": live["apiVersion"], "kind": live["kind"],
               "metadata": {"name": WHEEL, "namespace": NAMESPACE},
               "spec": {**live["spec"], "shards": SHARDS + 1}}
    err = _apply_refused(release, changed)
    assert f'The TimerWheel "{WHEEL}" is invalid' in err and "spec.shards" in err and "immutable" in err, err
    assert release.get("timerwheel", WHEEL)["spec"]["shards"] == SHARDS


def _condition(release: Release, name: str, kind: str) -> dict[str, Any]:
    tw = release.kubectl("get", "timerwheel", name, "-o", "json", check=False)
    conds = json.loads(tw.stdout).get("status", {}).get("conditions", []) if tw.returncode == 0 else []
    return next((c for c in conds if c["type"] == kind), {})


def test_a_timerwheel_that_cannot_run_says_why_in_degraded_ready_and_an_event(release: Release) -> None:
    """Three TimerWheels beside the release's, one stage pod each: an image tag the registry does
    not have, a claim no volume can bind (a storage class that does not exist), a stage that exits
    at once (its Redis URL, from a Secret, is not one). Each says so in Degraded and Ready, naming
    the cause, and in a warning Event."""
    uid, reg = release.pipe.uid, release.registry
    volume = release.volume_dir.parent / f"tw-e2e-broken-{uid}"
    volume.mkdir()
    os.chown(volume, 10001, 10001)
    claim = f"tw-e2e-broken-{uid}"
    release.k8s.apply(
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": claim},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": claim,
                  "persistentVolumeReclaimPolicy": "Retain", "claimRef": {"namespace": NAMESPACE, "name": claim},
                  "hostPath": {"path": str(volume), "type": "Directory"}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": NAMESPACE},
         "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": claim,
                  "resources": {"requests": {"storage": "1Gi"}}}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"bad-redis-{uid}", "namespace": NAMESPACE},
         "stringData": {"url": "http://not-redis:6379"}})
    one_pod = {"shards": 1, "deliveryReplicas": 0, "timerTopic": f"e2e-broken-{uid}",
               "dlqTopic": f"e2e-broken-dlq-{uid}", "kafka": {"bootstrap": release.kafka_pods},
               "stages": {"enqueueGet": {"replicas": 1}, "enqueuePut": {"replicas": 0}, "dequeueGet": {"replicas": 0}}}
    wheels = {
        "nopull": ({**one_pod, "redis": {"url": release.redis_pods}, "storage": {"existingClaim": claim},
                    "image": {"repository": reg.repository, "tag": "no-such-tag", "pullPolicy": "Always"}},
                   "ImagePullFailed", [f"{reg.repository}:no-such-tag"]),
        "noclaim": ({**one_pod, "redis": {"url": release.redis_pods},
                     "storage": {"storageClassName": f"tw-e2e-none-{uid}", "size": "1Gi"}},
                    "ClaimPending", ["timerwheel-noclaim-data is Pending", f"tw-e2e-none-{uid}"]),
        # no image: the operator's own, pulled with its pull secret (TIMERWHEEL_IMAGE_PULL_SECRETS)
        "crash": ({**one_pod, "redis": {"secretRef": {"name": f"bad-redis-{uid}"}}, "storage": {"existingClaim": claim}},
                  "CrashLooping", ["TW_REDIS_URL", "keeps exiting"]),
    }
    try:
        release.k8s.apply(*({"apiVersion": "timerwheel.io/v1alpha1", "kind": "TimerWheel",
                             "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}
                            for name, (spec, _reason, _said) in wheels.items()))
        deadline = time.monotonic() + 180
        for name, (_spec, reason, said) in wheels.items():
            while _condition(release, name, "Degraded").get("reason") != reason:
                assert time.monotonic() < deadline, f"{name}: {_condition(release, name, 'Degraded')}\n" + \
                    release.kubectl("get", "pods,pvc", "-o", "wide").stdout
                time.sleep(1)
            degraded, ready = _condition(release, name, "Degraded"), _condition(release, name, "Ready")
            assert degraded["status"] == "True" and (ready["status"], ready["reason"]) == ("False", reason), ready
            assert all(x in degraded["message"] for x in said), degraded["message"]
            events = release.get("events", "--field-selector", f"involvedObject.name={name},reason={reason}")["items"]
            assert [e["type"] for e in events] == ["Warning"], events
            print(f"[k8s diagnosis] {name}: {reason}: {degraded['message'][:300]}", flush=True)
    finally:
        release.kubectl("delete", "timerwheel", *wheels, "--wait=true", "--timeout=60s", check=False, timeout=90)
        release.kubectl("delete", "pvc", claim, "timerwheel-noclaim-data", "--wait=false", check=False)
        release.kubectl("delete", "secret", f"bad-redis-{uid}", check=False)
        release.k8s.kubectl("delete", "pv", claim, "--wait=false", check=False)


def test_ready_follows_a_stage_s_pod_within_seconds_not_the_period(release: Release) -> None:
    """A stage's only pod deleted: the TimerWheel is not Ready once the pod goes, and Ready again once
    its successor is, each within READY_LAG_S: the operator reacts to the pods and workloads it
    watches, not to its 10 s period (then each would lag 0-10 s, at random). Twice."""
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=release.k8s.kubeconfig)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)

    def wheel_ready() -> bool:
        tw = custom.get_namespaced_custom_object("timerwheel.io", "v1alpha1", NAMESPACE, "timerwheels", WHEEL)
        return any(c["type"] == "Ready" and c["status"] == "True" for c in tw.get("status", {}).get("conditions", []))

    def ready_pod() -> Any:
        pods = core.list_namespaced_pod(NAMESPACE, label_selector=f"app.kubernetes.io/instance={WHEEL},"
                                                                  "app.kubernetes.io/component=dequeue-getmsg").items
        return next((p for p in pods if p.metadata.deletion_timestamp is None and any(
            c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])), None)

    def successor_ready(gone: str) -> bool:
        found = ready_pod()
        return found is not None and found.metadata.uid != gone

    def until(ok: Any, what: str, timeout_s: float = 180) -> float:
        t0 = time.monotonic()
        while not ok():
            if time.monotonic() - t0 > timeout_s:
                pytest.fail(f"{what}: not within {timeout_s:.0f} s\n{release.diagnosis()}", pytrace=False)
            time.sleep(0.05)
        return time.monotonic()

    lags = []
    for _ in range(2):
        until(lambda: wheel_ready() and ready_pod() is not None, "the TimerWheel Ready")
        old = ready_pod()
        deleted = time.monotonic()
        core.delete_namespaced_pod(old.metadata.name, NAMESPACE)
        down = until(lambda: not wheel_ready(), "the TimerWheel not Ready after its pod went") - deleted
        back = until(functools.partial(successor_ready, old.metadata.uid), "a new dequeue-getmsg pod Ready")
        up = until(wheel_ready, "the TimerWheel Ready again") - back
        lags.append((round(down, 2), round(up, 2)))
    print(f"FIGURE TimerWheel Ready following a stage pod (not Ready after its deletion, Ready after its "
          f"successor's readiness), two runs: {lags} s", flush=True)
    assert all(down < READY_LAG_S and up < READY_LAG_S for down, up in lags), lags


def test_lateness_through_the_pods_at_200_per_second(release: Release) -> None:
    """A figure for BENCHMARKS.md (printed, not asserted): 200 msg/s for 60 s, delays 1-5 s. That
    nothing is lost or early is asserted."""
    pipe = release.pipe
    dest = pipe.new_dest("lateness", 4)
    with LoadRun(pipe, dest, seed=200, rate=200, min_delay_ms=1_000, max_delay_ms=5_000) as run:
        time.sleep(60)
        missing, rep = run.drain("k8s lateness 200/s", timeout_s=120)
    ways = {"the destination record's Kafka timestamp": rep.timestamp_lateness_ms,
            "tw-delivered-at": rep.lateness_ms, "the collector's receipt": rep.received_lateness_ms}
    print(f"FIGURE lateness through the pods, 200 msg/s for 60 s, delays 1-5 s, tick {TICK_MS} ms, p50 / p99 / max: "
          + "; ".join(f"by {way} {ms['p50']:.0f} / {ms['p99']:.0f} / {ms['max']:.0f} ms" for way, ms in ways.items())
          + f"; {rep.delivered} delivered, producer errors {run.load.errors}", flush=True)
    assert not missing and rep.lost == [] and rep.early == rep.early_received == [], rep.line() + release.diagnosis()
    assert rep.scheduled >= 200 * 50, rep.line()  # the load ran (the producer kept up)


def _delete_pod(release: Release, stage: str, timeout_s: float = 180) -> tuple[int, int]:
    """Delete the stage's pod (graceful, as a drain or an eviction does) and wait until a new pod
    of the stage is Ready. Returns (deleted at, replacement ready at) in epoch ms."""
    old = release.ready_pod(stage)
    assert old is not None, release.diagnosis()
    at = now_ms()
    release.kubectl("delete", "pod", old["metadata"]["name"], "--wait=false")
    deadline = time.monotonic() + timeout_s
    while True:
        new = release.ready_pod(stage)
        if new is not None and new["metadata"]["uid"] != old["metadata"]["uid"]:
            return at, now_ms()
        if time.monotonic() > deadline:
            pytest.fail(f"no new {stage} pod Ready {timeout_s:.0f} s after deleting "
                        f"{old['metadata']['name']}\n{release.diagnosis()}", pytrace=False)
        time.sleep(1)


def _upgrade_to(release: Release, guarantee: str, timeout_s: float = 300) -> float:
    """``helm upgrade --reuse-values`` with ``timerwheel.spec.deliveryGuarantee``, as a user
    switches the guarantee; waits until every stage runs a pod made after it with the new settings,
    Ready, and the TimerWheel Ready at its generation. Returns the seconds it took."""
    before = {p["metadata"]["uid"] for p in release.pods()}
    t0 = time.monotonic()
    done = release.helm("upgrade", RELEASE, str(ROOT / "charts" / "timerwheel"), "-n", NAMESPACE, "--reuse-values",
                        "--set", f"timerwheel.spec.deliveryGuarantee={guarantee}", "--wait", "--timeout", "300s")
    assert done.returncode == 0, done.stderr + release.diagnosis()

    def rolled() -> bool:
        pods = [p for p in release.pods() if not p["metadata"].get("deletionTimestamp")]
        new = [release.ready_pod(stage) for stage in STAGES]
        tw = release.get("timerwheel", WHEEL)
        ready = {c["type"]: c["status"] for c in tw["status"].get("conditions", [])}.get("Ready") == "True"
        return all(p is not None and p["metadata"]["uid"] not in before for p in new) \
            and not any(p["metadata"]["uid"] in before for p in pods) and ready \
            and tw["status"].get("observedGeneration") == tw["metadata"]["generation"]

    while not rolled():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"not every stage rolled to {guarantee} within {timeout_s:.0f} s\n{release.diagnosis()}",
                        pytrace=False)
        time.sleep(1)
    cm = release.get("configmap", "-l", f"app.kubernetes.io/instance={WHEEL}")["items"]
    assert any(c.get("data", {}).get("TW_DELIVERY_GUARANTEE") == guarantee for c in cm), cm
    return time.monotonic() - t0


def test_deleting_stage_pods_under_load_in_exactly_once_delivers_each_message_once(release: Release) -> None:
    """Issue 31 on the cluster: switched to exactly-once by a ``helm upgrade`` (the pods roll), the
    dequeue-put and enqueue-put pods deleted in turn under load; a ``read_committed`` collector
    sees every message once: nothing lost, early or duplicated."""
    took = _upgrade_to(release, "exactly-once")
    pipe = release.pipe
    dest = pipe.new_dest("chaos", 4)
    disruptions: list[tuple[str, int, int]] = []
    with LoadRun(pipe, dest, seed=6, rate=50, min_delay_ms=1_000, max_delay_ms=15_000, read_committed=True) as run:
        time.sleep(10)
        for stage in ("dequeue-put", "enqueue-put"):
            disruptions.append((stage, *_delete_pod(release, stage)))
            time.sleep(10)
        missing, rep = run.drain("k8s delete pods under load, exactly-once", timeout_s=120)
        dup_ids = {m: d for m, d in run.collector.by_id.items() if len(d) > 1}
    print(f"FIGURE k8s delete pods in exactly-once: rolled to it in {took:.1f} s; disruptions (stage, deleted at, "
          f"replacement ready at): {disruptions}; {rep.line()}", flush=True)
    assert not missing and rep.lost == [], f"lost {len(rep.lost)}\n{rep.line()}\n{release.diagnosis()}"
    assert rep.early == rep.early_received == [], rep.line()
    assert rep.scheduled >= 50 * 30, rep.line()
    assert dup_ids == {} and rep.duplicated == 0, f"{len(dup_ids)} delivered twice: {sorted(dup_ids)[:5]}\n{rep.line()}"


def test_helm_uninstall_keeps_the_crd_and_the_volume_claim(release: Release) -> None:
    done = release.helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "180s", timeout=240)
    assert done.returncode == 0, done.stderr + release.diagnosis()
    deadline = time.monotonic() + 120
    while (release.pods() or release.kubectl("get", "timerwheel", WHEEL, check=False).returncode == 0) \
            and time.monotonic() < deadline:
        time.sleep(2)
    assert release.kubectl("get", "timerwheel", WHEEL, check=False).returncode == 1, release.diagnosis()
    assert release.pods() == [], release.diagnosis()
    # nothing of `helm test` either (a passed test's Job is deleted by helm)
    assert release.kubectl("get", "jobs,pods", "-l", "app.kubernetes.io/component=test", "-o", "name").stdout == ""
    crd = release.k8s.get("crd", "timerwheels.timerwheel.io")
    assert crd["metadata"].get("deletionTimestamp") is None
    pvc = release.get("pvc", CLAIM)
    assert pvc["status"]["phase"] == "Bound" and pvc["metadata"].get("deletionTimestamp") is None, pvc
    assert (release.volume_dir / "shard-0000").is_dir()
