"""One SparkSession (local[2], Spark's Kafka connector on its class path) for every Spark test:
starting a JVM costs seconds; the jobs' ``session`` returns this one while it is active."""

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    pytest.importorskip("pyspark", reason="the Spark jobs need the .[spark] extra (make setup-spark)")
    from timerwheel.jobs.spark import session

    s = session("local[2]", app="timerwheel-tests")
    yield s
    s.stop()
