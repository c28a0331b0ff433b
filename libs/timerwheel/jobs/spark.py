"""The Spark session and Kafka through Spark's own connector (``spark-sql-kafka-0-10``).

The connector's jars come from ``scripts/spark.sh`` (Maven, cached outside the work tree) and are
passed as ``spark.jars``; ``TW_SPARK_JARS`` names a directory of them instead (the Spark image sets
it), and without either Spark resolves the connector itself (``spark.jars.packages``). One session
per process: ``session`` returns the active one if there is one, so tests share a single JVM.

The master is ``local[*]``, or ``k8s://<API server>`` on Spark's own Kubernetes scheduler (the
chart's ``spark.kubernetes``, docs/spark.md): this process is then the driver, in client mode, and
the image, the executors and their pod template come from ``spark-defaults.conf`` in
``SPARK_CONF_DIR``. The settings ``session`` makes below are the jobs' own and win over that file.

Kafka is reached with the service's own settings (``TimerConfig``: ``TW_KAFKA_*``, TLS and SASL):
``security.spark_kafka_options`` gives them to Spark's source and sink as ``kafka.``-prefixed Java
client properties, ``kafka_client_options`` to the admin client that lists the topics. Before Spark
starts, ``kafka_topics`` runs the stages' access check: a wrong password or an untrusted
certificate is one ``AccessError`` naming the setting, never minutes of Spark's retries.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from timerwheel.config import TimerConfig
from timerwheel.errors import TimerwheelError
from timerwheel.security import kafka_client_options, spark_kafka_options
from timerwheel.transports.kafka.access import check_kafka_access

#: The connector's Maven coordinate, at the PySpark version (pyproject.toml pins it).
CONNECTOR = "org.apache.spark:spark-sql-kafka-0-10_2.13"
_SPARK_SH = Path(__file__).resolve().parents[3] / "scripts" / "spark.sh"
#: Spark 4.2's ``spark.sql.sources.useV1SourceList`` without kafka.
V1_SOURCES = "avro,csv,json,orc,parquet,text"


class KafkaUnreachable(TimerwheelError):
    """The bootstrap servers did not answer."""


def connector_jars() -> list[str]:
    """The connector's jars: ``TW_SPARK_JARS`` (a directory), else ``scripts/spark.sh jars`` of
    this checkout; empty when neither exists (Spark then fetches the package itself)."""
    directory = os.environ.get("TW_SPARK_JARS", "")
    if directory:
        jars = sorted(str(p) for p in Path(directory).glob("*.jar"))
        if not jars:
            raise TimerwheelError(f"TW_SPARK_JARS: no jar in {directory}")
        return jars
    if _SPARK_SH.exists():
        out = subprocess.run([str(_SPARK_SH), "jars"], check=True, capture_output=True, text=True).stdout
        return [j for j in out.strip().split(",") if j]
    return []


def session(master: str = "local[*]", app: str = "timerwheel") -> Any:
    """The active SparkSession, else a new one on ``master`` with the connector on its class path;
    either way with the setting the jobs' header reading needs (``records.MAP_KEY_DEDUP``)."""
    from pyspark.sql import SparkSession

    from timerwheel.jobs.records import MAP_KEY_DEDUP

    active = SparkSession.getActiveSession()
    if active is not None:
        active.conf.set(*MAP_KEY_DEDUP)
        return active
    import pyspark

    # The UDFs' workers must run this interpreter, which has timerwheel installed (PySpark's
    # default is whatever "python3" is on the PATH).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (SparkSession.builder.master(master).appName(app)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")  # progress bars are not log lines
               .config("spark.sql.session.timeZone", "UTC")
               # small local jobs: a shuffle of 200 partitions costs more than the work
               .config("spark.sql.shuffle.partitions", os.environ.get("TW_SPARK_SHUFFLE_PARTITIONS", "8"))
               .config("spark.driver.memory", os.environ.get("TW_SPARK_DRIVER_MEMORY", "1g"))
               # the jobs cache compact columns read once or twice: compressing them cost the
               # 1,000,000 audit 0.5 s, for memory a spill to disk would stand in for
               .config("spark.sql.inMemoryColumnarStorage.compressed", "false")
               # PySpark's call-site capture for its error messages costs ~6 calls into the JVM per
               # column function: ~1,400 of the 3,650 that build the audit's main query (0.5 s)
               .config("spark.python.sql.dataFrameDebugging.enabled", "false")
               # Kafka through the connector's DataSource V2 scan (Spark's default lists kafka among
               # the V1 sources, whose rows are turned into Java Row objects and back): a plain read
               # of 2,000,000 records 4.8 s -> 3.7 s
               .config("spark.sql.sources.useV1SourceList", V1_SOURCES)
               # the order-independent shuffle checksum finds tasks whose retries differ; the jobs'
               # shuffles are of fixed Kafka offset ranges and files, so it is pure cost (hashing
               # every shuffled row: 3 % of the audit's CPU)
               .config("spark.sql.shuffle.orderIndependentChecksum.enabled", "false")
               .config(*MAP_KEY_DEDUP))
    jars = connector_jars()
    if jars:
        builder = builder.config("spark.jars", ",".join(jars))
    else:
        builder = builder.config("spark.jars.packages", f"{CONNECTOR}:{pyspark.__version__}")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def kafka_topics(config: TimerConfig, timeout_s: float = 10.0) -> set[str]:
    """The broker's topics; ``AccessError`` if it refuses ``config``'s TLS / SASL settings,
    ``KafkaUnreachable`` if it does not answer within ``timeout_s``. Checked before Spark starts:
    Spark's own client retries for minutes and then prints pages."""
    from kafka import KafkaAdminClient

    bootstrap = config.kafka_bootstrap
    check_kafka_access(config, bootstrap, timeout_s)
    ms = int(timeout_s * 1000)
    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=ms, bootstrap_timeout_ms=ms,
                                 **kafka_client_options(config))
    except Exception as exc:  # kafka-python raises NoBrokersAvailable, ValueError, socket errors
        raise KafkaUnreachable(f"--kafka: cannot reach Kafka at {bootstrap}: {exc.__class__.__name__}") from None
    try:
        return set(admin.list_topics())
    finally:
        admin.close()


def read_topics(spark: Any, config: TimerConfig, topics: list[str]) -> Any:
    """Every record of ``topics`` now (a batch read, earliest to latest), headers included:
    columns topic, partition, offset, timestamp, key, value, headers (array of key, value).
    At least as many Spark partitions as cores (``minPartitions``): a topic of fewer Kafka
    partitions is read in offset ranges side by side, not by one task."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if not topics:
        schema = T.StructType([
            T.StructField("key", T.BinaryType()), T.StructField("value", T.BinaryType()),
            T.StructField("topic", T.StringType()), T.StructField("partition", T.IntegerType()),
            T.StructField("offset", T.LongType()), T.StructField("timestamp", T.TimestampType()),
            T.StructField("timestampType", T.IntegerType()),
            T.StructField("headers", T.ArrayType(T.StructType([T.StructField("key", T.StringType()),
                                                               T.StructField("value", T.BinaryType())]))),
        ])
        df = spark.createDataFrame([], schema)
    else:
        df = (spark.read.format("kafka").options(**spark_kafka_options(config))
              .option("subscribe", ",".join(sorted(topics))).option("includeHeaders", "true")
              .option("startingOffsets", "earliest").option("endingOffsets", "latest")
              .option("failOnDataLoss", "false")
              # as every stage reads: a record of an aborted transaction was never scheduled (timer
              # topic) nor delivered (destination), so the audit counts only committed ones
              .option("kafka.isolation.level", "read_committed")
              .option("minPartitions", str(spark.sparkContext.defaultParallelism)).load())
    return df.withColumn("timestamp_ms", F.unix_millis("timestamp"))


def write_topic(df: Any, config: TimerConfig, topic: str) -> None:
    """Append ``df`` (key, value, headers[, partition]) to ``topic`` through Spark's Kafka sink."""
    (df.write.format("kafka").mode("append").options(**spark_kafka_options(config)).option("topic", topic)
     .option("kafka.enable.idempotence", "true").save())
