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

SEE ALSO
    sluice.pipeline.rules (the rules and why), sluice.pipeline.suppress
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from sluice.pipeline import expressions as X
from sluice.pipeline.rules import FAILURE_EVENTS
from sluice.pipeline.schema import CLASSIFIED_SCHEMA

__all__ = ["bounce_summary", "classify_failures"]


def classify_failures(events: DataFrame) -> DataFrame:
    """Failure events with category, hard and reason (CLASSIFIED_SCHEMA)."""
    failures = events.where(F.col("event").isin(*FAILURE_EVENTS))
    masked = X.with_masked(failures, "response", "_masked").withColumn(
        "_enh", F.coalesce(F.col("enhanced"), F.lit(""))
    )
    # The rules run once per distinct (event, code, masked text), not per row:
    # a day's millions of failures have a few thousand distinct reasons.
    keys = masked.select("event", "_enh", "_masked").distinct()
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
