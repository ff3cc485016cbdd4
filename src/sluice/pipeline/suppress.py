"""Suppress: recipients that should get no more mail, from their failures.

SUMMARY
    suppressions(events, soft_count=5, soft_days=7.0, soft_ttl_days=30.0,
                 until=None, classified=None) -> DataFrame (SUPPRESSION_SCHEMA)
    last_delivered(events) -> DataFrame (address, delivered_at)

DESCRIPTION
    A recipient is suppressed when

    - hard: it bounced with a hard category (bad-mailbox, bad-domain,
      inactive-mailbox; see sluice.pipeline.rules) and was not delivered to
      after that bounce; or
    - soft: its last ``soft_count`` final outcomes were all soft failures
      (a soft-category bounce, or an expiry), with no delivery in between,
      and all of them within the ``soft_days`` before ``until``.

    Final outcomes are what became of a message for the recipient:
    delivered, bounced or expired.  Deferrals are not outcomes -- five
    greylisting retries of one message are not five failures.

    Soft entries expire ``soft_ttl_days`` after their last failure (0 keeps
    them for ever): a full mailbox is emptied some day.  Hard entries do not
    expire.

STRATEGIES
    Addresses are normalised as sluice.suppression normalises them (angle
    brackets, trailing dot, case), so that the writer and the reader agree
    on every key.

    ``until`` defaults to the latest event in the input, not the clock:
    running the job on last month's logs gives last month's answer.

SEE ALSO
    sluice.suppression (file format, reader, merge), sluice.pipeline.bounces
"""

from __future__ import annotations

from datetime import datetime

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from sluice.pipeline.bounces import classify_failures
from sluice.pipeline.events import utc_instant
from sluice.pipeline.schema import SUPPRESSION_SCHEMA

__all__ = ["address", "last_delivered", "suppressions"]

DAY_S = 86400.0


def address(recipient: Column) -> Column:
    """sluice.suppression.normalise_address() as a column."""
    text = F.trim(recipient)
    text = F.regexp_replace(text, r"^<\s*(.*?)\s*>$", "$1")
    return F.lower(F.regexp_replace(text, r"\.+$", ""))


def last_delivered(events: DataFrame) -> DataFrame:
    """address, delivered_at: the latest delivery per address."""
    return (
        events.where(F.col("event") == "delivered")
        .groupBy(address(F.col("recipient")).alias("address"))
        .agg(F.max("time").alias("delivered_at"))
    )


def suppressions(
    events: DataFrame,
    soft_count: int = 5,
    soft_days: float = 7.0,
    soft_ttl_days: float = 30.0,
    until: datetime | None = None,
    classified: DataFrame | None = None,
) -> DataFrame:
    """EVENT_SCHEMA -> SUPPRESSION_SCHEMA, one row per suppressed address.

    ``classified`` may hand in classify_failures(events) when it has been
    computed already; it is derived from ``events`` otherwise.
    """
    if soft_count < 1:
        raise ValueError("soft_count must be at least 1")
    if soft_days <= 0:
        raise ValueError("soft_days must be greater than 0")
    if classified is None:
        classified = classify_failures(events.where(F.col("event").isin("bounced", "expired")))
    failed = classified.where(F.col("event").isin("bounced", "expired")).drop("reason")
    delivered = (
        events.where(F.col("event") == "delivered")
        .withColumn("category", F.lit(None).cast("string"))
        .withColumn("hard", F.lit(False))
    )
    outcomes = delivered.unionByName(failed)
    outcomes = outcomes.withColumn("address", address(F.col("recipient")))
    outcomes = outcomes.where(F.col("address").contains("@"))

    if until is None:
        bound = outcomes.agg(F.max("time").alias("_until"))
        outcomes = outcomes.crossJoin(F.broadcast(bound))
    else:
        outcomes = outcomes.withColumn("_until", F.lit(utc_instant(until)).cast("timestamp"))
        outcomes = outcomes.where(F.col("time") <= F.col("_until"))

    per_address = Window.partitionBy("address")
    ok_at = F.max(F.when(F.col("event") == "delivered", F.col("time"))).over(per_address)
    failures = outcomes.withColumn("_ok_at", ok_at).where(
        (F.col("event") != "delivered")
        & (F.col("_ok_at").isNull() | (F.col("time") > F.col("_ok_at")))
    )
    window_start = F.col("_until") - F.make_interval(secs=F.lit(soft_days * DAY_S))
    is_soft = ~F.col("hard") & (F.col("time") >= window_start)
    latest = F.struct("category", "code", "enhanced", "response")
    agg = failures.groupBy("address").agg(
        F.count_if(F.col("hard")).alias("_hard_n"),
        F.min(F.when(F.col("hard"), F.col("time"))).alias("_hard_first"),
        F.max(F.when(F.col("hard"), F.col("time"))).alias("_hard_last"),
        F.max_by(F.when(F.col("hard"), latest), F.when(F.col("hard"), F.col("time")))
        .alias("_hard_reply"),
        F.count_if(is_soft).alias("_soft_n"),
        F.min(F.when(is_soft, F.col("time"))).alias("_soft_first"),
        F.max(F.when(is_soft, F.col("time"))).alias("_soft_last"),
        F.max_by(F.when(is_soft, latest), F.when(is_soft, F.col("time"))).alias("_soft_reply"),
    )
    is_hard = F.col("_hard_n") > 0
    reply = F.when(is_hard, F.col("_hard_reply")).otherwise(F.col("_soft_reply"))
    last_at = F.when(is_hard, F.col("_hard_last")).otherwise(F.col("_soft_last"))
    expires = (
        F.when(
            ~is_hard & F.lit(soft_ttl_days > 0),
            last_at + F.make_interval(secs=F.lit(soft_ttl_days * DAY_S)),
        )
        if soft_ttl_days > 0
        else F.lit(None).cast("timestamp")
    )
    chosen = agg.where(is_hard | (F.col("_soft_n") >= soft_count)).select(
        F.col("address"),
        F.when(is_hard, F.lit("hard")).otherwise(F.lit("soft")).alias("reason"),
        reply["category"].alias("category"),
        reply["code"].alias("code"),
        reply["enhanced"].alias("enhanced"),
        reply["response"].alias("response"),
        F.when(is_hard, F.col("_hard_first")).otherwise(F.col("_soft_first")).alias("first_at"),
        last_at.alias("last_at"),
        F.when(is_hard, F.col("_hard_n")).otherwise(F.col("_soft_n")).cast("long").alias("count"),
        expires.cast("timestamp").alias("expires_at"),
    )
    return chosen.select(
        *[F.col(f.name).cast(f.dataType) for f in SUPPRESSION_SCHEMA.fields]
    ).orderBy("address")
