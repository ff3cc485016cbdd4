"""`sluice analytics ingest`: accounting lines appended to a Parquet table by day, once.

SUMMARY
    run_ingest(spark, inputs, table, since=None, until=None, step=...) -> JobResult

DESCRIPTION
    Every report over JSON lines parses all of them again; parsing is most
    of a report's cost.  Ingest parses them once into a Parquet table of
    EVENT_SCHEMA partitioned by day (``TABLE/day=2026-11-22/``), and the
    reports read the table instead (``--input TABLE``: sluice.pipeline.
    extract reads a directory of ``day=`` partitions as Parquet).

    Beside the events the table stores what every report would otherwise
    derive again: each failure's masked reply (STORED_SCHEMA, made by
    bounces.stored_masks with the id of the masking rules), so reports
    group and classify replies without running a regular expression.

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

STRATEGIES
    Stream.  The new rows are counted while they are written
    (DataFrame.observe), in one pass over the inputs; nothing is cached.

SEE ALSO
    sluice.pipeline.extract, docs/analytics.md
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import datetime

from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DateType, StructField, StructType

from sluice.accounting import EVENT_FIELDS
from sluice.pipeline import hfs
from sluice.pipeline.bounces import stored_masks
from sluice.pipeline.events import between
from sluice.pipeline.extract import expand_inputs, read_events
from sluice.pipeline.jobs import JobResult
from sluice.pipeline.schema import EVENT_SCHEMA, STORED_SCHEMA

__all__ = ["run_ingest"]

_KEY = "_key"

#: What the existing table is read as for its keys: explicit, so that a
#: table directory holding no data file yet reads as empty.
_KEYS_SCHEMA = StructType([*EVENT_SCHEMA.fields, StructField("day", DateType(), True)])


def _no_step(_: str) -> None:
    return None


def _counted(df: DataFrame, name: str) -> tuple[DataFrame, Observation]:
    """``df`` counting its rows as an action reads them, and where the count will be."""
    seen = Observation(name)
    return df.observe(seen, F.count(F.lit(1)).alias("n")), seen


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
    keyed, read = _counted(keyed, "read")
    fresh = keyed
    if hfs.exists(spark, table):
        days = [r.day for r in  # a few dates
                events.select(F.to_date(F.col("time")).alias("day")).distinct().collect()]
        old = (spark.read.schema(_KEYS_SCHEMA).parquet(table).where(F.col("day").isin(days))
               .select(F.sha2(F.to_json(F.struct(*EVENT_FIELDS)), 256).alias(_KEY), "day"))
        fresh = keyed.join(old, [_KEY, "day"], "left_anti")
    fresh, added = _counted(fresh, "added")
    step("ingest: appending")
    # One pass, streamed: the rows are counted as they are written, not
    # cached to be counted first (at 10M events that cache needed more
    # than 4 GB of driver memory).  An empty append writes no data file.
    (fresh.transform(stored_masks)
     .select(*EVENT_FIELDS, *STORED_SCHEMA.fieldNames(), "day")
     .write.mode("append").partitionBy("day").parquet(table))
    return JobResult("ingest", {"table": table},
                     {"events_read": read.get["n"], "events_added": added.get["n"]},
                     time.monotonic() - started)
