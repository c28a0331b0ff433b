"""The chart's Grafana dashboards, built here from the metrics the stages export
(``timerwheel.metrics``: COUNTERS, GAUGES, HISTOGRAMS) so that a panel can only name a family that
exists; ``timerwheel-operator dashboards DIR`` writes them as ``DIR/<uid>.json`` and a test keeps
``charts/timerwheel/dashboards/`` equal to it. The chart's ``dashboards.yaml`` puts each in a
ConfigMap for Grafana's dashboard sidecar.

Series carry the labels the chart's PodMonitor gives them: ``namespace``, ``pod``, ``timerwheel``
(the TimerWheel's name) and ``component`` (the stage). Each dashboard has the variables
``datasource``, ``namespace`` and ``timerwheel``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from timerwheel.metrics import COUNTERS, GAUGES, HISTOGRAMS

SEL = 'namespace="$namespace", timerwheel="$timerwheel"'
BY_SHARD = "namespace, timerwheel, shard"


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    expr: str
    legend: str
    unit: str
    kind: str = "timeseries"
    description: str = ""


@dataclass(frozen=True, slots=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]


DASHBOARDS = (
    Dashboard("timerwheel-overview", "timerwheel / overview",
              "Messages scheduled, delivered, cancelled and dead-lettered; lateness; what is due ahead; owners.", (
        Panel("Scheduled per second", f"sum by (topic) (rate(timerwheel_scheduled_total{{{SEL}}}[$__rate_interval]))",
              "{{topic}}", "ops"),
        Panel("Delivered per second", f"sum by (topic) (rate(timerwheel_delivered_total{{{SEL}}}[$__rate_interval]))",
              "{{topic}}", "ops"),
        Panel("Cancelled per second", f"sum by (topic) (rate(timerwheel_cancelled_total{{{SEL}}}[$__rate_interval]))",
              "{{topic}}", "ops"),
        Panel("Dead-lettered per second",
              f"sum by (topic) (rate(timerwheel_dead_lettered_total{{{SEL}}}[$__rate_interval]))", "{{topic}}", "ops",
              description="Records sent to the dead-letter topic (their tw-error says why)."),
        Panel("Delivery lateness p50 / p99",
              f"histogram_quantile(0.5, sum by (le) (rate(timerwheel_delivery_lateness_ms_bucket{{{SEL}}}"
              f"[$__rate_interval])))", "p50", "ms"),
        Panel("Delivery lateness p99",
              f"histogram_quantile(0.99, sum by (le) (rate(timerwheel_delivery_lateness_ms_bucket{{{SEL}}}"
              f"[$__rate_interval])))", "p99", "ms"),
        Panel("Peak due per second ahead (autoscaling input)",
              f"sum by (ahead_s) (timerwheel_due_peak_per_s{{{SEL}}})", "next {{ahead_s}} s", "ops",
              description="Messages per second of the busiest 10 s due within the horizon, all shards."),
        Panel("Shards owned per stage", f"sum by (stage) (timerwheel_owned_shards{{{SEL}}})", "{{stage}}", "none"),
        Panel("Cancel requests per second", f"sum(rate(timerwheel_cancel_requests_total{{{SEL}}}[$__rate_interval]))",
              "cancels read", "ops"),
    )),
    Dashboard("timerwheel-shards", "timerwheel / shards",
              "Per shard: W and R behind the clock, input wait, in flight, pending, TimerLog; the work queues.", (
        Panel("W behind the clock", f"time() * 1000 - max by ({BY_SHARD}) (timerwheel_write_ms{{{SEL}}})",
              "shard {{shard}}", "ms"),
        Panel("R behind the clock", f"time() * 1000 - max by ({BY_SHARD}) (timerwheel_read_ms{{{SEL}}})",
              "shard {{shard}}", "ms"),
        Panel("Input wait", f"max by ({BY_SHARD}) (timerwheel_input_wait_ms{{{SEL}}})", "shard {{shard}}", "ms",
              description="How long W has waited for timer records not yet written (enqueue-get, Kafka)."),
        Panel("In flight", f"max by ({BY_SHARD}) (timerwheel_in_flight{{{SEL}}})", "shard {{shard}}", "none"),
        Panel("Pending", f"max by ({BY_SHARD}) (timerwheel_pending{{{SEL}}})", "shard {{shard}}", "none"),
        Panel("TimerLog size", f"max by ({BY_SHARD}) (timerwheel_timerlog_bytes{{{SEL}}})", "shard {{shard}}",
              "bytes"),
        Panel("Owner epoch", f"max by ({BY_SHARD}, stage) (timerwheel_owner_epoch{{{SEL}}})",
              "shard {{shard}} {{stage}}", "none"),
        Panel("Work-queue depth", f"sum by (queue) (timerwheel_queue_depth{{{SEL}}})", "{{queue}}", "none"),
    )),
)


def families(expr: str) -> set[str]:
    """The ``timerwheel_*`` family names an expression reads (``_total``, ``_bucket`` stripped)."""
    names = set(re.findall(r"\btimerwheel_([a-z_]+?)(?:_total|_bucket|_sum|_count)?\{", expr))
    return names


def known(name: str) -> bool:
    return name in COUNTERS or name in GAUGES or name in HISTOGRAMS


def _panel(p: Panel, i: int) -> dict[str, Any]:
    return {
        "id": i + 1,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"refId": "A", "expr": p.expr, "legendFormat": p.legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}],
    }


def _variable(name: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": name, "type": "query", "query": {"query": query, "refId": name},
            "definition": query, "datasource": {"type": "prometheus", "uid": "${datasource}"}, "refresh": 2,
            "sort": 1, "includeAll": False, "multi": False, "hide": 0}


def dashboard_json(d: Dashboard) -> dict[str, Any]:
    """The Grafana dashboard model (schemaVersion 39) of ``d``."""
    return {
        "uid": d.uid,
        "title": d.title,
        "description": d.description,
        "tags": ["timerwheel"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "data source", "type": "datasource", "query": "prometheus", "hide": 0},
            _variable("namespace", "label_values(timerwheel_owned_shards, namespace)"),
            _variable("timerwheel", 'label_values(timerwheel_owned_shards{namespace="$namespace"}, timerwheel)'),
        ]},
        "panels": [_panel(p, i) for i, p in enumerate(d.panels)],
    }


def write_dashboards(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for d in DASHBOARDS:
        path = directory / f"{d.uid}.json"
        path.write_text(json.dumps(dashboard_json(d), indent=1) + "\n")
        out.append(path)
    return out
