"""Bounces: every failure classified into PowerMTA's categories, hard or soft.

SUMMARY
    classify_failures(events) -> DataFrame    EVENT_SCHEMA -> CLASSIFIED_SCHEMA
    bounce_summary(classified) -> DataFrame   counts per domain, event, category, hard

DESCRIPTION
    Deferrals, bounces and expirations are each given one category
    (bad-mailbox, bad-domain, inactive-mailbox, policy-related,
    spam-related, quota-issues, no-answer-from-host, message-expired,
    bad-connection, routing-errors, content-related, protocol-errors,
    relaying-issues, virus-related, invalid-sender, bad-configuration,
    other) from the RFC 3463 enhanced code and the reply text, by the
    ordered rules in sluice.pipeline.rules, and a masked reason.

    hard is true for a bounce in bad-mailbox, bad-domain or
    inactive-mailbox: the recipient address itself is bad.  Everything else
    -- every deferral, every expiry, and permanent refusals for policy,
    spam or content -- is soft.  The suppress job builds on this.

STRATEGIES
    Classify reasons, not rows.  Replies are masked first (rules.mask);
    a day's millions of failures then have a few thousand distinct
    (event, enhanced code, masked text) keys.  Those are collected and
    classified on the driver by rules.category_of(), and the small table
    is broadcast back to the rows: a CASE WHEN over some 35 regular
    expressions costs Spark seconds of code generation per query, the
    driver a few milliseconds.  Past DRIVER_KEYS_MAX distinct keys the same
    rules run as a Spark expression (sluice.pipeline.expressions).

SEE ALSO
    sluice.pipeline.rules (the rules and why), sluice.pipeline.suppress
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from sluice.pipeline import expressions as X
from sluice.pipeline.rules import FAILURE_EVENTS, category_of
from sluice.pipeline.schema import CLASSIFIED_SCHEMA

__all__ = ["bounce_summary", "classify_failures"]


#: Up to this many distinct (event, enhanced, masked reason) keys are
#: classified on the driver; more (a log whose replies defeat the masking)
#: are classified by the Spark expression instead.
DRIVER_KEYS_MAX = 200_000

_KEY_SCHEMA = "event string, _enh string, _masked string, category string"


def classify_failures(events: DataFrame, driver_keys_max: int = DRIVER_KEYS_MAX) -> DataFrame:
    """Failure events with category, hard and reason (CLASSIFIED_SCHEMA).

    Runs one Spark job at once: it collects the distinct masked reasons to
    classify them (see Strategies in the module docstring).
    """
    failures = events.where(F.col("event").isin(*FAILURE_EVENTS))
    masked = X.with_masked(failures, "response", "_masked").withColumn(
        "_enh", F.coalesce(F.col("enhanced"), F.lit(""))
    )
    keys = masked.select("event", "_enh", "_masked").distinct()
    found = keys.limit(driver_keys_max + 1).collect()
    if len(found) <= driver_keys_max:
        table = [(r["event"], r["_enh"], r["_masked"],
                  str(category_of(r["event"], r["_enh"], r["_masked"]))) for r in found]
        keyed = masked.sparkSession.createDataFrame(table, _KEY_SCHEMA)
        out = masked.join(F.broadcast(keyed), ["event", "_enh", "_masked"], "left")
    else:
        keyed = keys.withColumn("category", X.category(F.col("event"), F.col("_enh"),
                                                       F.col("_masked")))
        out = masked.join(keyed, ["event", "_enh", "_masked"], "left")
    out = out.withColumn("hard", X.hard(F.col("event"), F.col("category")))
    out = out.withColumn("reason", X.reason(F.col("code"), F.col("enhanced"), F.col("_masked")))
    return out.select(*CLASSIFIED_SCHEMA.fieldNames())


def bounce_summary(classified: DataFrame) -> DataFrame:
    """domain, event, category, hard, count, recipients -- biggest first."""
    return (
        classified.groupBy("domain", "event", "category", "hard")
        .agg(
            F.count(F.lit(1)).alias("count"),
            F.approx_count_distinct(F.lower(F.col("recipient"))).alias("recipients"),
        )
        .orderBy(F.col("count").desc(), "domain", "event", "category")
    )
