"""Report: delivery outcomes per destination, sender and hour, latency and top reasons.

SUMMARY
    outcomes(events) -> DataFrame          one pass, four levels; reads OUTCOME_COLUMNS
    level(outcomes, Level.HOURLY) -> DataFrame
    reasons(events) -> DataFrame           (event, domain, reason) counts
    top_reasons(reasons, n, by_domain=False) -> DataFrame
    largest_domains(by_domain, n) -> DataFrame   what the HTML page's charts draw

DESCRIPTION
    An operator's daily view of a sending platform.  Per recipient domain,
    tenantid, jobid, localip and remotemx, per hour: received, delivered,
    deferred attempts, bounced and expired counts; the delivery rate; queue
    time to delivery (p50, p95, p99); attempts per delivered message.  The
    same measures per hour, per domain and in total come out of the same
    aggregation.

    delivery_rate is delivered / (delivered + bounced + expired): the share
    of recipients that reached an end in that cell and were delivered.
    Deferrals are not an end; received is counted where the mail came in,
    which need not be the hour or the remote MX where it left.  Received
    events carry no remotemx, so in the hourly detail they form their own
    cells with an empty remotemx; per domain and in total they add up.

STRATEGIES
    Grouping sets.  The detail, per-hour, per-domain and total levels come
    from GROUPING SETS aggregations, so they add up by construction, and
    percentiles per domain are exact to the detail's own approximation
    (percentile_approx, accuracy 1000) rather than averaged from cells.

    Counts apart from percentiles.  percentile_approx keeps an object per
    cell, which puts a whole aggregation on Spark's interpreted object-hash
    path; alone it also sees only the deliveries (a third of the events).
    The counts are a separate, code-generated hash aggregation over all
    events, and the two meet in a join on the cell and its grouping id --
    about a third less work than one aggregation doing both.

    Counts per cell first.  The counts aggregate the events once, per
    detail cell, and the grouping sets then roll up the cells: every event
    passes through one hash aggregation instead of four (GROUPING SETS
    expands each row once per set).  The percentiles cannot be rolled up
    from cells and still expand the deliveries.

    Reasons are grouped after masking (rules.mask): "452 4.2.2 <addr>...
    mailbox full" is one reason whoever the recipient.

INVARIANTS
    Counts at every level add up to the total level, for every measure.

SEE ALSO
    sluice.pipeline.rules (masking), sluice.pipeline.html (the HTML page)
"""

from __future__ import annotations

from enum import StrEnum

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from sluice.pipeline import expressions as X

__all__ = [
    "DIMENSIONS",
    "MEASURES",
    "OUTCOME_COLUMNS",
    "Level",
    "largest_domains",
    "level",
    "outcomes",
    "reasons",
    "top_reasons",
]

#: What the detail level is grouped by, besides the hour.
DIMENSIONS: tuple[str, ...] = ("domain", "tenantid", "jobid", "localip", "remotemx")

#: The columns outcomes() reads: of most events the report needs no more.
OUTCOME_COLUMNS: tuple[str, ...] = ("time", "event", *DIMENSIONS, "queue_age_s", "attempt")

#: Measures, in output order.
MEASURES: tuple[str, ...] = (
    "received",
    "delivered",
    "deferred",
    "bounced",
    "expired",
    "delivery_rate",
    "queue_p50_s",
    "queue_p95_s",
    "queue_p99_s",
    "attempts_per_delivered",
)

#: percentile_approx accuracy: 1/1000 relative rank error -- plenty for
#: queue times, and each of the many detail cells keeps a smaller sketch.
PERCENTILE_ACCURACY = 1000


class Level(StrEnum):
    """How far the report's outcome table is rolled up."""
    HOURLY = "hourly"  # every dimension and the hour
    HOUR = "hour"  # per hour, all destinations
    DOMAIN = "domain"  # per recipient domain, all hours
    TOTAL = "total"  # one row


#: The event kinds the report counts, in output order.
_KINDS: tuple[str, ...] = ("received", "delivered", "deferred", "bounced", "expired")


def _count(kind: str) -> Column:
    return F.count_if(F.col("event") == kind).cast("long")


def outcomes(events: DataFrame) -> DataFrame:
    """EVENT_SCHEMA -> level, hour, DIMENSIONS..., MEASURES (all four levels)."""
    delivered = F.col("event") == "delivered"
    # A session line is a connection, not a recipient: no cell of its own.
    with_hour = events.where(F.col("event") != "session").select(
        *[F.col(c) for c in OUTCOME_COLUMNS if c != "time"],
        F.date_trunc("hour", F.col("time")).alias("hour"),
    )
    keys = [*DIMENSIONS, "hour"]
    sets = [keys, ["hour"], ["domain"], []]
    # Counted per detail cell in one code-generated pass over the events,
    # then the cells (far fewer) rolled up into the four levels: sums of
    # counts are exact, and the average is kept as its sum and count.
    attempt = F.when(delivered, F.col("attempt"))
    cells = with_hour.groupBy(*keys).agg(
        *[_count(kind).alias(kind) for kind in _KINDS],
        F.sum(attempt).alias("_attempts"),
        F.count(attempt).alias("_attempted"),
    )
    counts = cells.groupingSets(sets, *keys).agg(
        *[F.sum(kind).alias(kind) for kind in _KINDS],
        # avg() sums an int column as a double: the same value as this
        # exact sum of longs for any count of attempts a log can hold.
        F.when(F.sum("_attempted") > 0,
               F.sum("_attempts").cast("double") / F.sum("_attempted").cast("double"))
        .alias("attempts_per_delivered"),
        F.grouping_id().alias("_gid"),
    )
    pcts = with_hour.where(delivered & F.col("queue_age_s").isNotNull()).groupingSets(
        sets, *keys
    ).agg(
        F.percentile_approx(F.col("queue_age_s"), [0.5, 0.95, 0.99], PERCENTILE_ACCURACY)
        .alias("_pct"),
        F.grouping_id().alias("_gid"),
    )
    # Grouped-away keys are null, and a dimension may be null itself.
    same_cell = [counts[k].eqNullSafe(pcts[k]) for k in keys] + [counts["_gid"] == pcts["_gid"]]
    agg = counts.join(pcts, same_cell, "left").select(
        *[counts[c] for c in counts.columns], pcts["_pct"]
    )
    # grouping_id() bits, highest first, follow keys: domain ... hour.
    bit = {k: 1 << (len(keys) - 1 - i) for i, k in enumerate(keys)}
    agg = agg.select(
        "*",
        *[
            (F.col("_gid").bitwiseAND(bit[k]) != 0).cast("tinyint").alias(name)
            for k, name in (("domain", "_g_domain"), ("tenantid", "_g_tenant"),
                            ("hour", "_g_hour"))
        ],
    )
    ended = F.col("delivered") + F.col("bounced") + F.col("expired")
    lvl = (
        F.when((F.col("_g_tenant") == 0) & (F.col("_g_hour") == 0), F.lit(str(Level.HOURLY)))
        .when(F.col("_g_domain") == 0, F.lit(str(Level.DOMAIN)))
        .when(F.col("_g_hour") == 0, F.lit(str(Level.HOUR)))
        .otherwise(F.lit(str(Level.TOTAL)))
    )
    return agg.select(
        lvl.alias("level"),
        F.col("hour"),
        *[F.col(d) for d in DIMENSIONS],
        F.col("received"),
        F.col("delivered"),
        F.col("deferred"),
        F.col("bounced"),
        F.col("expired"),
        F.when(ended > 0, F.col("delivered") / ended).alias("delivery_rate"),
        F.col("_pct")[0].alias("queue_p50_s"),
        F.col("_pct")[1].alias("queue_p95_s"),
        F.col("_pct")[2].alias("queue_p99_s"),
        F.col("attempts_per_delivered"),
    )


_LEVEL_COLUMNS: dict[Level, tuple[str, ...]] = {
    Level.HOURLY: ("hour", *DIMENSIONS),
    Level.HOUR: ("hour",),
    Level.DOMAIN: ("domain",),
    Level.TOTAL: (),
}


def level(outcome_rows: DataFrame, which: Level) -> DataFrame:
    """One level of outcomes(), with only the columns that level groups by."""
    keys = _LEVEL_COLUMNS[which]
    rows = outcome_rows.where(F.col("level") == str(which)).select(*keys, *MEASURES)
    # The detail can be millions of cells: sorting them is the reader's job.
    return rows.orderBy(*keys) if keys and which is not Level.HOURLY else rows


def largest_domains(by_domain: DataFrame, n: int) -> DataFrame:
    """The ``n`` largest domains by attempts, and the ``n`` largest by deliveries.

    From the domain level; all the HTML report's charts draw (at most 2n
    rows, however many domains there are).
    """
    attempts = F.col("delivered") + F.col("deferred") + F.col("bounced") + F.col("expired")
    # Both rankings in one pass over by_domain: a union of two limits would
    # be planned twice, and the second branch misses the cached outcomes
    # and recomputes them.
    by_attempts = Window.orderBy(attempts.desc(), "domain")
    by_delivered = Window.orderBy(F.col("delivered").desc(), "domain")
    ranked = by_domain.select(
        "*",
        F.row_number().over(by_attempts).alias("_by_attempts"),
        F.row_number().over(by_delivered).alias("_by_delivered"),
    )
    top = ranked.where((F.col("_by_attempts") <= n) | (F.col("_by_delivered") <= n))
    return top.drop("_by_attempts", "_by_delivered")


def reasons(events: DataFrame) -> DataFrame:
    """EVENT_SCHEMA (or CLASSIFIED_SCHEMA) -> event, domain, reason, count, example.

    Failures only.  Classified events already carry their reason; plain
    events are masked here.
    """
    failures = events.where(F.col("event").isin("deferred", "bounced", "expired"))
    if "reason" not in failures.columns:
        failures = X.with_masked(failures, "response", "_masked").withColumn(
            "reason", X.reason(F.col("code"), F.col("enhanced"), F.col("_masked"))
        )
    return failures.groupBy("event", "domain", "reason").agg(
        F.count(F.lit(1)).alias("count"), F.min("response").alias("example")
    )


def top_reasons(reason_rows: DataFrame, n: int = 10, by_domain: bool = False) -> DataFrame:
    """The n most frequent reasons per event kind (and per domain if asked)."""
    if n < 1:
        raise ValueError("n must be at least 1")
    if by_domain:
        rows = reason_rows
        part = ["event", "domain"]
    else:
        rows = reason_rows.groupBy("event", "reason").agg(
            F.sum("count").alias("count"), F.min("example").alias("example")
        )
        part = ["event"]
    window = Window.partitionBy(*part).orderBy(F.col("count").desc(), F.col("reason"))
    ranked = rows.withColumn("rank", F.row_number().over(window)).where(F.col("rank") <= n)
    return ranked.select(*part, "rank", "reason", "count", "example").orderBy(*part, "rank")
