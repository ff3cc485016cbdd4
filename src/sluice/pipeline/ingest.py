"""`sluice analytics ingest`: accounting lines appended to a Parquet table by day, once.

SUMMARY
    run_ingest(spark, inputs, table, since=None, until=None, step=...) -> JobResult

DESCRIPTION
    Every report over JSON lines parses all of them again; parsing is most
    of a report's cost.  Ingest parses them once into a Parquet table of
    EVENT_SCHEMA partitioned by day (``TABLE/day=2026-11-22/``), and the
    reports read the table instead (``--input TABLE``: sluice.pipeline.
    extract reads a directory of ``day=`` partitions as Parquet).

    Idempotent: each event's key is a hash of all its fields (as JSON, so
    a null and an empty string differ); an event whose key is already in
    the table's partition for its day is not appended again.  Running it
    twice on the same files adds nothing, and running it every few
    minutes on the hour's growing file appends only the lines written
    since.  Only the days the new lines touch are read back for the check.

LIMITATIONS
    Two events identical in every field (the same recipient, kind, time to
    the millisecond, attempt, reply ...) are one event here.  Two ingests
    into the same table at the same time are not coordinated: run one at a
    time (a cron job, not two).

SEE ALSO
    sluice.pipeline.extract, docs/analytics.md
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import datetime

from pyspark import StorageLevel
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from sluice.accounting import EVENT_FIELDS
from sluice.pipeline import hfs
from sluice.pipeline.events import between
from sluice.pipeline.extract import expand_inputs, read_events
from sluice.pipeline.jobs import JobResult

__all__ = ["run_ingest"]

_KEY = "_key"


def _no_step(_: str) -> None:
    return None


def run_ingest(
    spark: SparkSession,
    inputs: Sequence[str],
    table: str,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    step: Callable[[str], None] = _no_step,
) -> JobResult:
    """Append the events of ``inputs`` not in ``table`` yet, partitioned by day.

    Returns the events read and added.
    """
    started = time.monotonic()
    step("ingest: reading")
    events = read_events(spark, expand_inputs(inputs)).transform(between, since=since,
                                                                 until=until)
    keyed = (events.withColumn(_KEY, F.sha2(F.to_json(F.struct(*EVENT_FIELDS)), 256))
             .withColumn("day", F.to_date(F.col("time")))
             .dropDuplicates([_KEY]))
    fresh = keyed
    if hfs.exists(spark, table):
        days = [r.day for r in keyed.select("day").distinct().collect()]  # a few dates
        old = (spark.read.parquet(table).where(F.col("day").isin(days))
               .select(F.sha2(F.to_json(F.struct(*EVENT_FIELDS)), 256).alias(_KEY), "day"))
        fresh = keyed.join(old, [_KEY, "day"], "left_anti")
    fresh = fresh.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        step("ingest: appending")
        added = fresh.count()
        read = keyed.count()
        if added:
            (fresh.select(*EVENT_FIELDS, "day").write.mode("append").partitionBy("day")
             .parquet(table))
    finally:
        fresh.unpersist()
    return JobResult("ingest", {"table": table},
                     {"events_read": read, "events_added": added},
                     time.monotonic() - started)
