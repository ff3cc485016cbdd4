"""Shape: what each destination tolerates, from its throttling replies.

SUMMARY
    attempts(events) -> DataFrame            delivery attempts with group and throttle kind
    throttle_findings(events) -> DataFrame   one row per (localip, destination) that throttled
    per_destination(findings) -> DataFrame   the lowest advice per destination (the policy's rows)

DESCRIPTION
    Large mailbox providers answer "421 4.7.0 Try again later, closing
    connection", "451 4.7.1 ... rate limited" or "421 Too many concurrent
    SMTP connections" when a sender goes faster than they allow.  Per
    source IP and destination (the remote MX rolled up into a group: all of
    Google's MX hosts are one destination, as the pickup policy's groups
    will count them), this job finds those replies (rules.throttle_kind)
    and estimates what the destination accepted:

    rate         for replies about volume: the attempts per minute it still
                 answered without throttling (deliveries, bounces, ordinary
                 deferrals) in the minutes in which it throttled (median over
                 those minutes); the advice is 90 % of that.  None when it
                 accepted fewer than MIN_ACCEPTED_PER_MIN a minute: a
                 destination that throttles at one a minute speaks of
                 reputation, not of a rate, and "1/60" helps nobody.
    concurrency  how many attempts were in flight when a throttling reply
                 came (median); the advice is one less, at least 1.  Only
                 given when the replies speak of connections.
    connectinterval
                 for "connection rate" replies: the seconds between
                 connections that the accepted rate implies.

    No advice from little evidence: a destination that sent fewer than
    MIN_THROTTLES throttling replies is listed in the findings with no
    rate, concurrency or interval.  Greylisting and replies about one
    mailbox (X.2.X) are not throttles (sluice.pipeline.rules.throttle_kind).

    sluice.pipeline.policy turns the findings into a Halon-format pickup
    policy, and sluice.pipeline.advice into shaping rules.

STRATEGIES
    In-flight counts come from the log alone: an attempt that ended at
    ``time`` after ``duration_s`` was in flight from time - duration_s.
    A running sum over start (+1) and end (-1) marks per destination gives
    the count at each start; ends sort before starts at the same instant.

    No skew.  One running sum over all of a (source IP, destination)'s
    marks would sort them in one task -- a third of a day's attempts when
    the destination is Gmail.  The sum is taken in two levels instead:
    per minute (the minute's own marks, sorted in its own task) plus the
    sum of all earlier minutes (a running sum over one row per minute).
    Same counts, and a key's work spreads over its minutes.

LIMITATIONS
    An estimate from what happened, not a measurement of the limit: a
    destination that was never pushed hard shows no throttling and gets no
    advice.  Attempts without a duration (connection failures) count for
    the rate but not for in-flight numbers.

SEE ALSO
    sluice.pipeline.rules (throttle wording, provider groups),
    sluice.pipeline.policy, Halon's pickup policies (specification)
"""

from __future__ import annotations

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from sluice.pipeline import expressions as X
from sluice.pipeline.rules import ThrottleKind
from sluice.shaping.advice_apply import RATE_MARGIN  # stay a little under what worked

__all__ = ["attempts", "inflight_marks", "per_destination", "throttle_findings"]

#: Fewer throttling replies than this from a destination make no advice:
#: one deferral is an incident, not a limit.
MIN_THROTTLES = 3
#: A destination that throttled while it accepted fewer than this many
#: attempts a minute is not telling a rate (too little traffic to see one;
#: it is reputation or a block): no rate or interval is advised for it.
MIN_ACCEPTED_PER_MIN = 5


def attempts(events: DataFrame) -> DataFrame:
    """Delivery attempts with ``destination`` (MX group) and ``throttle`` kind."""
    tried = events.where(
        F.col("event").isin("delivered", "deferred", "bounced") & F.col("remotemx").isNotNull()
    )
    return tried.select(
        F.coalesce(F.col("localip"), F.lit("")).alias("localip"),
        X.mx_group(F.col("remotemx")).alias("destination"),
        F.lower(F.col("remotemx")).alias("remotemx"),
        F.col("time"),
        F.col("event"),
        F.col("duration_s"),
        F.col("code"),
        F.col("enhanced"),
        F.col("response"),
        X.throttle(F.col("code"), F.col("enhanced"), F.col("response")).alias("throttle"),
    )


#: In-flight counts are summed per minute first (see Strategies).
BUCKET_US = 60_000_000


def inflight_marks(tried: DataFrame) -> DataFrame:
    """Each attempt's start (+1) and end (-1) with the count in flight after it.

    Columns: localip, destination, t (µs), delta, thr, inflight.
    """
    timed = tried.where(F.col("duration_s").isNotNull())
    end_us = F.unix_micros(F.col("time"))
    start_us = end_us - (F.col("duration_s") * 1_000_000).cast("long")
    throttled = F.col("throttle").isNotNull()
    marks = timed.select(
        "localip",
        "destination",
        F.explode(
            F.array(
                F.struct(start_us.alias("t"), F.lit(1).alias("delta"), throttled.alias("thr")),
                F.struct(end_us.alias("t"), F.lit(-1).alias("delta"), F.lit(False).alias("thr")),
            )
        ).alias("m"),
    ).select("localip", "destination", "m.t", "m.delta", "m.thr")
    keys = ["localip", "destination"]
    marks = marks.withColumn("_b", F.floor(F.col("t") / F.lit(BUCKET_US)))
    # The count entering each minute: the deltas of all earlier minutes.  One
    # row per key and minute, so this window stays small however busy a key is.
    carry = marks.groupBy(*keys, "_b").agg(F.sum("delta").alias("_d")).withColumn(
        "_carry",
        F.coalesce(F.sum("_d").over(Window.partitionBy(*keys).orderBy("_b").rowsBetween(
            Window.unboundedPreceding, -1)), F.lit(0)),
    ).drop("_d")
    within = Window.partitionBy(*keys, "_b").orderBy("t", "delta").rowsBetween(
        Window.unboundedPreceding, Window.currentRow)
    return (marks.join(carry, [*keys, "_b"])
            .withColumn("inflight", F.col("_carry") + F.sum("delta").over(within))
            .drop("_b", "_carry"))


def _inflight_at_throttle(tried: DataFrame) -> DataFrame:
    inflight = inflight_marks(tried)
    return inflight.groupBy("localip", "destination").agg(
        F.max("inflight").alias("max_inflight"),
        F.percentile_approx(
            F.when((F.col("delta") == 1) & F.col("thr"), F.col("inflight")), 0.5
        ).alias("inflight_at_throttle"),
    )


def throttle_findings(events: DataFrame) -> DataFrame:
    """EVENT_SCHEMA -> one row per (localip, destination) with throttling replies.

    Columns: localip, destination, sample_mx, attempts, delivered, throttled,
    rate_throttles, connection_throttles, connect_rate_throttles,
    peak_per_min, accepted_per_min, max_inflight, inflight_at_throttle,
    rate_per_min, concurrency, connectinterval_s, example, first_at, last_at.
    """
    tried = attempts(events)
    keys = ["localip", "destination"]
    minute = (
        tried.groupBy(*keys, F.date_trunc("minute", F.col("time")).alias("minute"))
        .agg(
            # Everything the destination answered without a throttle counts
            # against its limit: bounces and ordinary deferrals too.
            F.count_if(F.col("throttle").isNull()).alias("ok"),
            F.count_if(F.col("throttle").isNotNull()).alias("thr"),
        )
        .groupBy(*keys)
        .agg(
            F.max("ok").alias("peak_per_min"),
            F.percentile_approx(F.when(F.col("thr") > 0, F.col("ok")), 0.5).alias(
                "accepted_per_min"
            ),
        )
    )
    totals = tried.groupBy(*keys).agg(
        F.count(F.lit(1)).alias("attempts"),
        F.min("remotemx").alias("sample_mx"),
        F.count_if(F.col("event") == "delivered").alias("delivered"),
        F.count_if(F.col("throttle").isNotNull()).alias("throttled"),
        F.count_if(F.col("throttle") == str(ThrottleKind.RATE)).alias("rate_throttles"),
        F.count_if(F.col("throttle") == str(ThrottleKind.CONNECTIONS)).alias(
            "connection_throttles"
        ),
        F.count_if(F.col("throttle") == str(ThrottleKind.CONNECT_RATE)).alias(
            "connect_rate_throttles"
        ),
        F.min(F.when(F.col("throttle").isNotNull(), F.concat_ws(
            " ", F.col("code").cast("string"), F.col("enhanced"), F.col("response")
        ))).alias("example"),
        F.min(F.when(F.col("throttle").isNotNull(), F.col("time"))).alias("first_at"),
        F.max(F.when(F.col("throttle").isNotNull(), F.col("time"))).alias("last_at"),
    )
    found = (
        totals.where(F.col("throttled") > 0)
        .join(minute, keys, "left")
        .join(_inflight_at_throttle(tried), keys, "left")
    )
    accepted = F.coalesce(F.col("accepted_per_min"), F.lit(0))
    enough = F.col("throttled") >= MIN_THROTTLES
    measured = enough & (accepted >= MIN_ACCEPTED_PER_MIN)
    rate = F.when(
        measured & (F.col("rate_throttles") > 0), F.floor(accepted * RATE_MARGIN)
    ).cast("long")
    concurrency = F.when(
        enough & (F.col("connection_throttles") > 0),
        F.greatest(F.lit(1), F.coalesce(F.col("inflight_at_throttle"), F.lit(2)) - 1),
    ).cast("long")
    interval = F.when(
        measured & (F.col("connect_rate_throttles") > 0),
        F.round(F.lit(60.0) / accepted.cast("double"), 2),
    )
    return found.select(
        *keys,
        "sample_mx",
        "attempts",
        "delivered",
        "throttled",
        "rate_throttles",
        "connection_throttles",
        "connect_rate_throttles",
        "peak_per_min",
        "accepted_per_min",
        "max_inflight",
        "inflight_at_throttle",
        rate.alias("rate_per_min"),
        concurrency.alias("concurrency"),
        interval.alias("connectinterval_s"),
        "example",
        "first_at",
        "last_at",
    ).orderBy(*keys)


def per_destination(findings: DataFrame) -> DataFrame:
    """One row per destination, as policy.limits_from_findings combines them.

    The lowest rate and concurrency, the longest interval.
    """
    return findings.groupBy("destination").agg(
        F.min("sample_mx").alias("sample_mx"),
        F.min("rate_per_min").alias("rate_per_min"),
        F.min("concurrency").alias("concurrency"),
        F.max("connectinterval_s").alias("connectinterval_s"),
        F.sum("throttled").alias("throttled"),
        F.min("example").alias("example"),
    ).orderBy("destination")
