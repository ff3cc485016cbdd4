"""Bounces: every failure classified into PowerMTA's categories, hard or soft.

SUMMARY
    classify_failures(events) -> DataFrame    EVENT_SCHEMA -> CLASSIFIED_SCHEMA
    with_masked_reply(events) -> DataFrame    events plus MASKED_COLUMN (failures only)
    stored_masks(events) -> DataFrame         events plus STORED_SCHEMA, for ingest
    classify_masked(masked) -> DataFrame      the same, from with_masked_reply() rows
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

    Mask once.  Masking is the costly step (eight regular expressions per
    reply), and the distinct keys and the classified rows both need it.
    classify_failures() masks in the plan of its result, so a caller that
    reads the result more than once should persist it; run_jobs() instead
    masks while it caches the events (with_masked_reply) and classifies the
    cached rows with classify_masked(), which masks nothing again.

    Mask at ingest.  An ingested table stores each failure's mask
    (stored_masks(), STORED_SCHEMA) with the id of the rules that made it;
    with_masked_reply() takes a stored mask the current rules made and
    masks only the rest, so a report over such a table runs no regular
    expression at all.

SEE ALSO
    sluice.pipeline.rules (the rules and why), sluice.pipeline.suppress
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from sluice.pipeline import expressions as X
from sluice.pipeline.rules import FAILURE_EVENTS, MASK_RULES_ID, category_of
from sluice.pipeline.schema import CLASSIFIED_SCHEMA, STORED_MASK, STORED_RULES, STORED_SCHEMA

__all__ = [
    "MASKED_COLUMN",
    "bounce_summary",
    "classify_failures",
    "classify_masked",
    "stored_masks",
    "with_masked_reply",
]


#: Up to this many distinct (event, enhanced, masked reason) keys are
#: classified on the driver -- an aggregate, a few hundred KB at most; more
#: (a log whose replies defeat the masking) are classified by the Spark
#: expression instead, without collecting anything.
DRIVER_KEYS_MAX = 20_000

#: The masked reply text that with_masked_reply() adds (null but for failures).
MASKED_COLUMN = "_masked"

_KEY_SCHEMA = "event string, _enh string, _masked string, category string"


def _is_failure() -> Column:
    return F.col("event").isin(*FAILURE_EVENTS)


def with_masked_reply(events: DataFrame) -> DataFrame:
    """Add MASKED_COLUMN to ``events``: rules.mask(response) for failures, null otherwise.

    Other events skip the regular expressions: only failures are classified.
    Where ``events`` carry a mask stored by ingest (STORED_SCHEMA) that the
    current rules made, that is taken instead, and only the rest is masked.
    """
    failure = _is_failure()
    stored: Column | None = None
    if STORED_MASK in events.columns and STORED_RULES in events.columns:
        stored = F.coalesce(F.col(STORED_RULES) == F.lit(MASK_RULES_ID), F.lit(False))
        failure_to_mask = failure & ~stored
    else:
        failure_to_mask = failure
    # A row not to mask enters the rules as null, i.e. "": every guard fails
    # at once and no regular expression runs on it.
    masked = X.with_masked(
        events.withColumn(MASKED_COLUMN, F.when(failure_to_mask, F.col("response"))),
        MASKED_COLUMN,
        MASKED_COLUMN,
    )
    value = F.col(MASKED_COLUMN) if stored is None else (
        F.when(stored, F.col(STORED_MASK)).otherwise(F.col(MASKED_COLUMN)))
    return masked.withColumn(MASKED_COLUMN, F.when(failure, value))


def stored_masks(events: DataFrame) -> DataFrame:
    """EVENT_SCHEMA -> EVENT_SCHEMA + STORED_SCHEMA, as ingest writes a table.

    Every event gets the current MASK_RULES_ID, so that a later report
    knows the null mask of a delivery was not left out but never needed.
    """
    plain = events.drop(*STORED_SCHEMA.fieldNames())
    return (with_masked_reply(plain).withColumnRenamed(MASKED_COLUMN, STORED_MASK)
            .withColumn(STORED_RULES, F.lit(MASK_RULES_ID).cast("long")))


def classify_failures(events: DataFrame, driver_keys_max: int = DRIVER_KEYS_MAX) -> DataFrame:
    """Failure events with category, hard and reason (CLASSIFIED_SCHEMA).

    Runs one Spark job at once: it collects the distinct masked reasons to
    classify them (see Strategies in the module docstring).
    """
    failures = events.where(_is_failure())
    return classify_masked(with_masked_reply(failures), driver_keys_max)


def classify_masked(masked: DataFrame, driver_keys_max: int = DRIVER_KEYS_MAX) -> DataFrame:
    """classify_failures() of events that with_masked_reply() has masked.

    Reads ``masked`` twice (the distinct keys, then the rows): persist it.
    """
    masked = masked.where(_is_failure()).withColumn(
        "_enh", F.coalesce(F.col("enhanced"), F.lit(""))
    )
    keys = masked.select("event", "_enh", MASKED_COLUMN).distinct()
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
