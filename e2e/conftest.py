"""End-to-end fixtures: the real Kafka and Redis servers, shared with tests/ (tests/infra.py), and
the real local Kubernetes cluster (k8s_cluster.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from infra import (  # noqa: E402
    kafka_bootstrap,
    kafka_cluster3,
    kafka_control,
    kafka_noauto_bootstrap,
    redis_control,
    redis_url,
    secure_kafka,
    secure_redis,
)
from k8s_cluster import k8s, registry  # noqa: E402

__all__ = ["k8s", "registry", "kafka_bootstrap", "kafka_cluster3", "kafka_control", "kafka_noauto_bootstrap", "redis_control", "redis_url",
           "secure_kafka", "secure_redis"]


#: Fixtures whose binary ``scripts/prebuild.sh`` builds in the background while the first tests run
#: (helm; the chart's console tests ask for promtool through it too).
PREBUILT = frozenset({"helm", "promtool"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the Kubernetes cluster run last: the cluster's first start builds it (half an
    hour on a fresh machine) and loads the machine, and it is torn down at the session's end.
    Before them the tests that need a binary ``make test`` builds in the background (helm,
    promtool): run early on a fresh machine, they waited minutes for its build; run after the
    rest, they find it built."""
    def order(item: pytest.Item) -> tuple[bool, bool]:
        prebuilt = not PREBUILT.isdisjoint(getattr(item, "fixturenames", ()))
        return item.get_closest_marker("k8s") is not None, prebuilt

    items.sort(key=order)
