"""Reconcile one TimerWheel: levels, not edges.

``ensure`` reads the spec and applies every manifest it implies (server-side apply: running it
again changes nothing, so kopf replaying an event or the timer calling it every interval is
safe). ``observe`` reads the stage workloads and scrapes the stages' ``/metrics`` into the
status. Neither raises on a bad spec or an unreachable pod: both end up in the status.
``reconcile`` does both, scraping first when autoscaling is on: the load ahead decides the
replicas of the dequeue stages (``autoscale.decide``), whose last decision is kept in the status.

Every decision is an Event (``Applied.events``): a stage whose workload runs another replica
count than the one applied (``Scaled``, from the spec; ``Autoscaled``, from the load). As they
compare the live workload with the desired count, a replayed event or a restarted operator
posts nothing new once the workload has its count.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from timerwheel_operator import diagnosis, jobs, kafka_access, manifests
from timerwheel_operator import recovery as rcv
from timerwheel_operator import retention as ret
from timerwheel_operator import window as win
from timerwheel_operator.autoscale import Decision, Load, decide
from timerwheel_operator.crd import DELIVERY_STAGES, SHARD_OWNERS, STAGES
from timerwheel_operator.diagnosis import Blocker
from timerwheel_operator.kube import Cluster
from timerwheel_operator.spec import HTTP_PORT, SpecError, Wheel, read, with_claim, workload_name
from timerwheel_operator.stage_metrics import (
    MetricsParseError,
    Sample,
    ShardStatus,
    parse_prometheus,
    shard_status,
)
from timerwheel_operator.status import (
    Care,
    StageState,
    compute,
    invalid_spec_status,
    now_rfc3339,
    unobserved_status,
)


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    """The operator's own configuration (``main.config_from_env``): what a TimerWheel's stages get
    when its spec names no image."""

    image: str = "timerwheel:dev"
    pull_policy: str = "IfNotPresent"
    pull_secrets: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Event:
    """A decision to post on the TimerWheel (``kopf.info`` / ``kopf.warn``)."""

    reason: str
    message: str
    warning: bool = False


@dataclass(frozen=True, slots=True)
class Applied:
    wheel: Wheel | None
    error: SpecError | None
    failures: dict[str, str]
    events: list[Event] = field(default_factory=list)


def _workload_kind(stage: str) -> str:
    return "StatefulSet" if stage in SHARD_OWNERS else "Deployment"


def read_live(body: Mapping[str, Any], config: OperatorConfig, cluster: Cluster) -> Wheel:
    """``read`` the TimerWheel (raises ``SpecError``), knowing its volume claim as the cluster has
    it: the claim's access modes decide whether its pods share one node (``Wheel.single_node``)."""
    wheel = read(body, config.image, config.pull_policy, config.pull_secrets)
    try:
        claim = cluster.get("v1", "PersistentVolumeClaim", wheel.namespace, wheel.claim)
    except Exception:  # noqa: BLE001 - not readable: the spec's access modes stand in
        claim = None
    return with_claim(wheel, claim)


def ensure(body: Mapping[str, Any], cluster: Cluster, config: OperatorConfig,
           replicas: Mapping[str, int] | None = None, why: Mapping[str, str] | None = None) -> Applied:
    """Apply what the TimerWheel ``body`` implies. A bad spec applies nothing; an object the API
    server refuses is recorded in ``failures`` (kind/name -> reason) and the rest still applied.
    ``replicas`` overrides the spec's count of some stages, for the reason in ``why``."""
    try:
        wheel = read_live(body, config, cluster)
    except SpecError as exc:
        return Applied(None, exc, {})
    failures: dict[str, str] = {}
    events = []
    for stage in STAGES:
        if not wheel.stage(stage).operator_replicas:
            continue
        want = (replicas or {}).get(stage, wheel.stage(stage).replicas)
        live = cluster.get("apps/v1", _workload_kind(stage), wheel.namespace, workload_name(wheel.name, stage))
        have = (live or {}).get("spec", {}).get("replicas") if live else None
        if have is not None and int(have) != want:
            source = (why or {}).get(stage)
            events.append(Event("Autoscaled" if source and source.startswith("autoscale") else "Scaled",
                                f"{stage}: {have} -> {want} replicas ({source or 'spec'})"))
    for manifest in manifests.build_all(wheel, body, replicas):
        try:
            cluster.apply(manifest)
        except Exception as exc:  # an API refusal of one object must not stop the others
            reason = getattr(exc, "reason", None) or str(exc)
            failures[f"{manifest['kind']}/{manifest['metadata']['name']}"] = str(reason)[:300]
    return Applied(wheel, None, failures, events)


def _stage_states(wheel: Wheel, cluster: Cluster, replicas: Mapping[str, int] | None = None) -> dict[str, StageState]:
    out = {}
    for stage in STAGES:
        workload = cluster.get("apps/v1", _workload_kind(stage), wheel.namespace, workload_name(wheel.name, stage))
        desired = (replicas or {}).get(stage, wheel.stage(stage).replicas)
        if not wheel.stage(stage).operator_replicas and workload is not None:
            desired = int((workload.get("spec") or {}).get("replicas") or 0)  # whoever scales it decides
        out[stage] = StageState.of(desired, workload)
    return out


def scrape_all(wheel: Wheel, cluster: Cluster, stages: Sequence[str] = SHARD_OWNERS,
               ) -> tuple[dict[str, list[Sample]], dict[str, str]]:
    """``/metrics`` of every running pod of ``stages`` (the shard-owning ones by default):
    (pod -> samples, pod -> error)."""
    samples: dict[str, list[Sample]] = {}
    errors: dict[str, str] = {}
    for stage in stages:
        for pod in cluster.pods(wheel.namespace, manifests.selector(wheel.name, stage)):
            name = str(pod.get("metadata", {}).get("name"))
            status = pod.get("status") or {}
            ip = status.get("podIP")
            if status.get("phase") != "Running" or not ip:
                continue
            try:
                samples[name] = parse_prometheus(cluster.scrape(ip, HTTP_PORT))
            except (OSError, MetricsParseError) as exc:
                errors[name] = str(exc)[:200]
    return samples, errors


def tend(wheel: Wheel, body: Mapping[str, Any], cluster: Cluster, shards: Sequence[ShardStatus],
         stages: Mapping[str, StageState], now_ms: int, events: list[Event], failures: dict[str, str]) -> Care:
    """Day-2 care of the shards, levels not edges: run, follow and record the recovery Jobs
    (``recovery.decide``) and restart the owner of a stalled shard (``recovery.stalled``), from the
    shards just observed, the Jobs that exist and the last status."""
    policy = wheel.recovery
    before = {int(x["shard"]): x for x in (body.get("status") or {}).get("shards") or [] if "shard" in x}
    care = Care()
    try:
        found: jobs.Found[int] | None = jobs.follow(
            cluster, wheel.namespace, manifests.selector(wheel.name, manifests.RECOVERY), rcv.shard_of,
            lambda shard: rcv.recorded(before.get(shard, {}).get("recovery")))
    except Exception as exc:  # noqa: BLE001 - no Jobs readable: no recovery this round, said in Degraded
        failures["Job/list"] = str(getattr(exc, "reason", None) or exc)[:300]
        found = None
    running = found is not None and found.running
    for st in shards:
        prev = before.get(st.shard, {})
        record = prev.get("recovery")
        if found is not None:
            step = rcv.decide(st, record, found.newest.get(st.shard), found.finished.get(st.shard), policy, running,
                              now_ms)
            record = dict(step.record) if step.record is not None else None
            if step.start_job and record is not None:
                manifest = manifests.recovery_job(wheel, st.shard, int(record["serial"]), body)
                refused = jobs.start(cluster, manifest)
                if refused is None:
                    record.update(job=manifest["metadata"]["name"], state=jobs.RUNNING)
                    running = True
                else:  # said in Degraded, tried next round
                    failures[f"Job/{manifest['metadata']['name']}"] = refused
                    record = dict(prev.get("recovery") or {}) or None
                    step = rcv.RecoveryStep()
            if step.event is not None:
                reason, message, warning = step.event
                events.append(Event(reason, message, warning))
        if record is not None:
            care.recovery[st.shard] = record
        w_since = rcv.advanced(prev, "W", st.write_ms, now_ms)
        r_since = rcv.advanced(prev, "R", st.read_ms, now_ms)
        care.advanced[st.shard] = (w_since, r_since)
        downstream = all(stages[s].ready > 0 for s in ("dequeue-getmsg", "dequeue-put"))
        cap = wheel.config.wheel_slots * wheel.config.tick_ms - wheel.config.roll_window_ms - wheel.config.tick_ms
        for stall in rcv.stalled(st, w_since, r_since, policy, now_ms, cap, wheel.config.tick_ms, downstream):
            care.stalls.append(stall)
            last = int(prev.get("restartedMs") or 0)
            if policy.restart_stalled and now_ms - last >= policy.stall_after_ms:
                try:
                    cluster.delete_pod(wheel.namespace, stall.pod)
                except Exception as exc:  # noqa: BLE001 - said in the Event, tried again next round
                    events.append(Event("ShardStalled", f"{rcv.stall_message([stall])}; cannot delete pod "
                                        f"{stall.pod}: {exc}"[:500], True))
                    continue
                care.restarted[st.shard] = now_ms
                events.append(Event("ShardStalled", f"{rcv.stall_message([stall])}: deleted pod {stall.pod} "
                                    "(restarted by its StatefulSet)", True))
            elif prev.get("restartedMs") is not None:
                care.restarted[st.shard] = last
    return care


def observe(body: Mapping[str, Any], applied: Applied, cluster: Cluster,
            scraped: tuple[dict[str, list[Sample]], dict[str, str]] | None = None,
            replicas: Mapping[str, int] | None = None, now_ms: int | None = None) -> dict[str, Any]:
    """The status to write (a merge patch of ``.status``); ``scraped``: what ``scrape_all``
    read already this round, ``replicas``: the counts applied instead of the spec's. With
    ``now_ms`` the shards are tended too (``tend``: recovery Jobs, stalls)."""
    generation = int(body.get("metadata", {}).get("generation") or 0)
    previous = (body.get("status") or {}).get("conditions") or []
    now = now_rfc3339()
    if applied.error is not None or applied.wheel is None:
        return invalid_spec_status(generation, str(applied.error), previous, now)
    wheel = applied.wheel
    try:
        stages = _stage_states(wheel, cluster, replicas)
        samples, errors = scraped if scraped is not None else scrape_all(wheel, cluster)
    except Exception as exc:  # the API server refused a read: say so, keep the last figures
        return unobserved_status(generation, f"cannot read the stage workloads or pods: {exc}"[:300], previous, now)
    shards = shard_status(samples, wheel.config.shards)
    care = None
    if now_ms is not None:
        care = tend(wheel, body, cluster, shards, stages, now_ms, applied.events, applied.failures)
    return compute(generation, stages, shards, previous, now, errors, applied.failures, care,
                   blockers_of(wheel, cluster))


def blockers_of(wheel: Wheel, cluster: Cluster) -> list[Blocker]:
    """What Kubernetes says stops the TimerWheel's pods (``diagnosis``); none when it cannot be read."""
    now = dt.datetime.now(dt.UTC)
    try:
        pods = cluster.pods(wheel.namespace, manifests.wheel_pods(wheel.name))
        claim = wheel.live_claim
        pending = claim is not None and diagnosis.claim_blocker(claim, [], now, wheel.access_modes) is not None
        events = cluster.events(wheel.namespace, "PersistentVolumeClaim", wheel.claim) if pending else []
    except Exception:  # noqa: BLE001 - a diagnosis is extra: the status stands without it
        return []
    return diagnosis.diagnose(pods, wheel.live_claim, events, now, wheel.access_modes)


def blocker_events(previous: Sequence[Mapping[str, Any]], status: Mapping[str, Any]) -> list[Event]:
    """A warning Event when ``Degraded`` turns to one of the diagnosis' reasons (once per change)."""
    def degraded(conditions: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
        return next((c for c in conditions if c.get("type") == "Degraded" and c.get("status") == "True"), {})

    now, before = degraded(status.get("conditions") or []), degraded(previous)
    if now.get("reason") in diagnosis.ORDER and now.get("reason") != before.get("reason"):
        return [Event(str(now["reason"]), str(now.get("message") or "")[:1000], True)]
    return []


#: The input queue of each autoscaled stage (its ``queue_depth{queue=...}``).
INPUT_QUEUE = {"dequeue-getmsg": "fetch", "dequeue-put": "deliver"}


def load_of(stage: str, horizon_s: int, samples: Mapping[str, Sequence[Sample]], shards: int) -> Load:
    """The load an autoscaled stage faces: per shard, the ``due_peak_per_s`` of the pod owning
    it for dequeue-get (highest epoch), summed; and its input queue's depth (any pod of the
    stage reports it: the queue is shared), summed over partitions."""
    shard_pods = {st.shard: st.reader for st in shard_status(samples, shards) if st.reader is not None}
    peak = 0.0
    depth: dict[str, int] = {}
    for pod, pod_samples in samples.items():
        for x in pod_samples:
            shard = x.label("shard")
            if (x.name == "timerwheel_due_peak_per_s" and x.label("ahead_s") == str(horizon_s)
                    and shard is not None and shard.isdigit() and shard_pods.get(int(shard)) == pod):
                peak += x.value
            elif x.name == "timerwheel_queue_depth" and x.label("queue") == INPUT_QUEUE[stage]:
                key = str(x.label("partition"))
                depth[key] = max(depth.get(key, 0), int(x.value))
    return Load(peak_per_s=peak, queue_depth=sum(depth.values()))


def autoscale(wheel: Wheel, body: Mapping[str, Any], cluster: Cluster, samples: Mapping[str, Sequence[Sample]],
              now_ms: int) -> dict[str, Decision]:
    """The autoscaler's decision per autoscaled stage. The current count is the live workload's
    (else the last decision's, else the spec's); the last change's time is in the status."""
    last = (body.get("status") or {}).get("autoscale") or {}
    out = {}
    for stage, policy in wheel.autoscale.items():
        live = cluster.get("apps/v1", "Deployment", wheel.namespace, workload_name(wheel.name, stage))
        current = (live or {}).get("spec", {}).get("replicas") if live else None
        if current is None:
            current = (last.get(stage) or {}).get("replicas", wheel.stage(stage).replicas)
        changed_ms = (last.get(stage) or {}).get("lastChangeMs")
        load = load_of(stage, policy.horizon_s(), samples, wheel.config.shards)
        out[stage] = decide(policy, int(current), load, now_ms, None if changed_ms is None else int(changed_ms))
    return out


#: Why the shard owners are at 0 replicas during a window change (the ``Scaled`` Event says it).
PAUSED = "window change: paused"


def window_round(wheel: Wheel, body: Mapping[str, Any], cluster: Cluster, admin: ret.Admin | None, now_ms: int,
                 failures: dict[str, str]) -> win.WindowStep:
    """The window's step this round (``window.decide``) from the status, the ConfigMap, the window
    Jobs, the owner pods and the timer topic's retention; starts the rebuild Job it asks for."""
    status = body.get("status") or {}
    prev = dict(status.get("window") or {})
    desired = win.Window(wheel.config.tick_ms, wheel.config.roll_window_ms, int(wheel.env["TW_WHEEL_SPAN_MS"]))
    live = cluster.get("v1", "ConfigMap", wheel.namespace, manifests.settings_name(wheel))
    running = win.Window.of_env((live or {}).get("data")) or desired
    # The shards' window: the status's (unknown after a failed rebuild), else the ConfigMap's.
    current = None if prev.get("currentUnknown") else win.Window.of_spec(prev.get("current")) or running
    try:
        found: jobs.Found[str] = jobs.follow(cluster, wheel.namespace, manifests.selector(wheel.name, manifests.WINDOW),
                                             lambda _job: manifests.WINDOW, lambda _key: win.recorded(prev))
    except Exception as exc:  # noqa: BLE001 - said in Degraded (ApplyFailed); no Job starts blind
        failures["Job/list"] = str(getattr(exc, "reason", None) or exc)[:300]
        return win.decide(desired, current, running, prev, None, None, None, False,
                          int(body.get("metadata", {}).get("generation") or 0), now_ms)
    newest, finished = found.newest.get(manifests.WINDOW), found.finished.get(manifests.WINDOW)
    target = win.Window.of_spec(prev.get("target"))
    pending = not desired.same(current) and not (prev.get("phase") in ("Pausing", "Rebuilding")
                                                 and target is not None and target.same(desired))
    check = None
    if admin is not None:
        last = ret.Check.of_status(status.get("retention"))
        roll = desired.roll_window_ms if pending or current is None else current.roll_window_ms
        if pending or last is None or now_ms - last.checked_ms >= ret.CHECK_EVERY_MS \
                or last.needed_ms != ret.needed_ms(roll) or last.topic != wheel.config.timer_topic:
            check = ret.keep(admin, lambda: kafka_access.access(wheel, cluster), wheel.config.timer_topic, roll,
                             wheel.manage_retention, now_ms)
        else:
            check = last
    stopped = all(not cluster.pods(wheel.namespace, manifests.selector(wheel.name, s)) for s in SHARD_OWNERS)
    step = win.decide(desired, current, running, prev, newest, finished, check, stopped,
                      int(body.get("metadata", {}).get("generation") or 0), now_ms)
    step.retention = check
    if step.start_job is not None:
        serial, want = step.start_job
        job = manifests.window_job(wheel, serial, want.env(), want.annotation(), body)
        refused = jobs.start(cluster, job)
        if refused is None:
            step.status["job"] = job["metadata"]["name"]
        else:  # said in Degraded, tried next round
            failures[f"Job/{job['metadata']['name']}"] = refused
            step.status = {**prev, "phase": "Pausing"}
            step.condition = (True, "Pausing", f"cannot start the rebuild Job: {refused}"[:300])
    return step


def _with_window(body: Mapping[str, Any], window: win.Window) -> dict[str, Any]:
    """``body`` with ``window`` as its spec's tick, roll window and span: what the stages run now."""
    return {**body, "spec": {**(body.get("spec") or {}), **window.to_spec()}}


def reconcile(body: Mapping[str, Any], cluster: Cluster, config: OperatorConfig, now_ms: int,
              admin: ret.Admin | None = None) -> tuple[Applied, dict[str, Any]]:
    """One round: the window's step, scrape, decide the autoscaled replicas, apply, and the status
    to write. ``admin``: Kafka's admin API for the timer topic's retention (None: not checked)."""
    try:
        wheel = read_live(body, config, cluster)
    except SpecError:
        applied = ensure(body, cluster, config)
        return applied, observe(body, applied, cluster)
    failures: dict[str, str] = {}
    try:
        step = window_round(wheel, body, cluster, admin, now_ms, failures)
    except Exception as exc:  # noqa: BLE001 - never crash the round: keep the stages as they are, say why
        failures["window"] = f"{type(exc).__name__}: {exc}"[:300]
        prev = (body.get("status") or {}).get("window") or {}
        kept = win.Window.of_spec(prev.get("current")) or win.Window(
            wheel.config.tick_ms, wheel.config.roll_window_ms, int(wheel.env["TW_WHEEL_SPAN_MS"]))
        step = win.WindowStep(kept, prev.get("phase") in (*win.ROLLING, "Failed"), dict(prev),
                              (prev.get("phase") in win.ROLLING, str(prev.get("reason") or "Unknown"),
                               str(prev.get("message") or "")))
    effective = _with_window(body, step.run)
    applied, status = _round(effective, wheel, cluster, config, now_ms,
                             {s: 0 for s in SHARD_OWNERS} if step.pause else {})
    applied.failures.update(failures)
    if failures:
        status = observe(effective, applied, cluster, replicas={s: 0 for s in SHARD_OWNERS} if step.pause else None)
    generation = int(body.get("metadata", {}).get("generation") or 0)
    previous = (body.get("status") or {}).get("conditions") or []
    for reason, message, warning in step.events + win.apply_to_status(status, step, generation, previous,
                                                                      now_rfc3339(), now_ms):
        applied.events.append(Event(reason, message, warning))
    if step.retention is not None:
        status["retention"] = step.retention.to_status()
    for key in ("window", "retention"):  # a merge patch keeps what it does not name: null drops a key
        before = (body.get("status") or {}).get(key) or {}
        if key in status:
            status[key].update({k: None for k in before if k not in status[key]})
    applied.events.extend(blocker_events(previous, status))
    status["deliverySelector"] = ",".join(f"{k}={v}" for k, v in manifests.selector(wheel.name, "x").items()
                                          if k != "app.kubernetes.io/component") + \
        f",app.kubernetes.io/component in ({','.join(DELIVERY_STAGES)})"
    return applied, status


def _round(body: Mapping[str, Any], wheel: Wheel, cluster: Cluster, config: OperatorConfig, now_ms: int,
           paused: Mapping[str, int]) -> tuple[Applied, dict[str, Any]]:
    """Scrape, autoscale, apply and observe ``body`` (the window it runs already in its spec);
    ``paused``: stages held at 0 replicas whatever else says."""
    wheel = read(body, config.image, config.pull_policy, config.pull_secrets)
    if not wheel.autoscale:
        applied = ensure(body, cluster, config, dict(paused) or None, {s: PAUSED for s in paused})
        return applied, observe(body, applied, cluster, replicas=dict(paused) or None, now_ms=now_ms)
    stages = [*SHARD_OWNERS, *wheel.autoscale]
    try:
        scraped = scrape_all(wheel, cluster, stages)
    except Exception:  # noqa: BLE001 - cannot read the pods: keep the replicas as they are, observe says why
        kept = {**_kept(body, wheel), **paused}
        applied = ensure(body, cluster, config, kept, {s: PAUSED for s in paused})
        return applied, observe(body, applied, cluster, replicas=kept, now_ms=now_ms)
    decisions = autoscale(wheel, body, cluster, scraped[0], now_ms)
    replicas = {**{s: d.replicas for s, d in decisions.items()}, **paused}
    applied = ensure(body, cluster, config, replicas, {**{s: f"autoscale: {d.message}" for s, d in decisions.items()},
                                                         **{s: PAUSED for s in paused}})
    status = observe(body, applied, cluster, scraped, replicas, now_ms)
    last = (body.get("status") or {}).get("autoscale") or {}
    status["autoscale"] = {
        s: {"replicas": d.replicas, "reason": d.reason, "message": d.message[:300],
            "lastChangeMs": now_ms if d.changed else int((last.get(s) or {}).get("lastChangeMs") or now_ms)}
        for s, d in decisions.items()}
    return applied, status


def _kept(body: Mapping[str, Any], wheel: Wheel) -> dict[str, int]:
    last = (body.get("status") or {}).get("autoscale") or {}
    return {s: int(last[s]["replicas"]) for s in wheel.autoscale if (last.get(s) or {}).get("replicas")}
