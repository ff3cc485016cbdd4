"""Events: the accounting log made one clean, typed table.

SUMMARY
    normalise_events(raw) -> events      RAW_EVENT_SCHEMA -> EVENT_SCHEMA
    conform_events(df, extra=None) -> events   any event-like table -> EVENT_SCHEMA
    between(events, since, until) -> events
    parse_when(text, now) -> datetime    "2026-11-22", "2026-11-22T10:00Z", "24h" (ago)

DESCRIPTION
    The accounting log is written by many processes over months; the
    pipeline must read old and odd lines without failing the whole job.
    Normalisation drops lines that are not JSON or have no parseable time,
    lower-cases the event kind and the domain, and fills an empty domain
    from the recipient address.  Everything else is kept as written.

    Times are parsed without a format string: Spark's ISO 8601 parser takes
    the log's ``2026-11-22T10:00:00.123Z`` as well as offsets and missing
    fractions, and try_to_timestamp() yields null instead of failing the
    job under ANSI mode.

INVARIANTS
    The result has exactly EVENT_SCHEMA (followed by the ``extra`` fields
    asked for) and no row with a null time or a null event kind.

SEE ALSO
    sluice.accounting (the writer), sluice.pipeline.extract
"""

from __future__ import annotations

from datetime import UTC, datetime

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructType

from sluice.config import parse_duration
from sluice.pipeline.schema import CORRUPT_COLUMN, EVENT_SCHEMA

__all__ = ["between", "conform_events", "normalise_events", "parse_when", "utc_instant"]


def _time(df: DataFrame) -> Column:
    if "time" not in df.columns:
        return F.lit(None).cast("timestamp")
    if isinstance(df.schema["time"].dataType, StringType):
        return F.try_to_timestamp(F.col("time"))
    return F.col("time").cast("timestamp")


def conform_events(df: DataFrame, extra: StructType | None = None) -> DataFrame:
    """Any table with (some of) the event columns -> EVENT_SCHEMA, cleaned.

    The fields of ``extra`` follow, null where ``df`` has no such column
    (an ingested table's STORED_SCHEMA, say).
    """
    cols: list[Column] = []
    for field in [*EVENT_SCHEMA.fields, *(extra.fields if extra is not None else ())]:
        if field.name == "time":
            col = _time(df)
        elif field.name in df.columns:
            col = F.col(field.name).cast(field.dataType)
        else:
            col = F.lit(None).cast(field.dataType)
        cols.append(col.alias(field.name))
    typed = df.select(*cols)
    domain_from_rcpt = F.lower(F.regexp_extract(F.col("recipient"), r"@([^@]*)$", 1))
    return (
        typed.where(F.col("time").isNotNull() & F.col("event").isNotNull())
        .withColumn("event", F.lower(F.trim(F.col("event"))))
        .withColumn(
            "domain",
            F.when(
                F.col("domain").isNull() | (F.col("domain") == ""),
                F.regexp_replace(domain_from_rcpt, r"\.$", ""),
            ).otherwise(F.lower(F.col("domain"))),
        )
    )


def normalise_events(raw: DataFrame, extra: StructType | None = None) -> DataFrame:
    """RAW_EVENT_SCHEMA (JSON as read) -> EVENT_SCHEMA (+ ``extra``, null); bad lines dropped."""
    if CORRUPT_COLUMN in raw.columns:
        raw = raw.where(F.col(CORRUPT_COLUMN).isNull()).drop(CORRUPT_COLUMN)
    return conform_events(raw, extra)


def between(
    events: DataFrame, since: datetime | None = None, until: datetime | None = None
) -> DataFrame:
    """Events with since <= time < until (either bound may be open)."""
    out = events
    if since is not None:
        out = out.where(F.col("time") >= F.lit(utc_instant(since)))
    if until is not None:
        out = out.where(F.col("time") < F.lit(utc_instant(until)))
    return out


def utc_instant(at: datetime) -> datetime:
    """``at`` as an aware datetime, UTC when it had no zone.

    PySpark turns a naive datetime into an instant through the Python
    process's local zone, an aware one exactly; so hand it an aware one.
    """
    # PySpark turns a naive datetime into an instant through the Python
    # process's local zone, an aware one exactly; so hand it an aware one.
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return at


def parse_when(text: str, now: datetime | None = None) -> datetime:
    """An ISO date/time (UTC unless it says otherwise) or a duration ago.

    Raises ValueError with a message fit for an operator.
    """
    value = text.strip()
    try:
        ago = parse_duration(value)
    except ValueError:
        ago = None
    if ago is not None and not value.replace(".", "").isdigit():
        base = now or datetime.now(UTC)
        return datetime.fromtimestamp(base.timestamp() - ago, UTC)
    try:
        at = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{text!r} is neither a date/time (2026-11-22, 2026-11-22T10:00Z) "
            "nor a duration ago (24h, 7d)"
        ) from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return at.astimezone(UTC)
