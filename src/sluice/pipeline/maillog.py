"""Maillog: a Postfix maillog as Sluice accounting events.

SUMMARY
    parse_lines(lines, year=None, tz="UTC", now=None) -> DataFrame   syslog records
    maillog_events(records) -> DataFrame                             EVENT_SCHEMA

DESCRIPTION
    Postfix logs one line per step: smtpd/pickup (``client=``, ``uid=``)
    and cleanup (``message-id=``) when a message arrives, qmgr
    (``from=<...>, size=N, nrcpt=N``) when it enters the active queue, the
    delivery agents (smtp, lmtp, relay, error, ...: ``to=<...>, relay=...,
    delay=..., delays=a/b/c/d, dsn=X.Y.Z, status=sent|deferred|bounced
    (reply)``) per recipient and attempt, qmgr ``status=expired, returned
    to sender`` when the queue lifetime ran out, and bounce ``sender
    non-delivery notification: QID``.  This module turns them into the
    accounting events Sluice writes, so that report, bounces, suppress and
    shape run unchanged on a Postfix platform.

    Mapping: sent -> delivered, deferred -> deferred, bounced -> bounced,
    qmgr expired -> one expired event per recipient whose last status was
    deferred, bounce notification -> one ndr event per failed recipient, and
    one received event per recipient at the message's arrival.  The queue
    id is the spid; qid is ``QUEUEID-n``, n numbering the recipients in the
    order they first appear.  queue_age_s is Postfix's delay=, duration_s
    the connection set-up plus transmission parts of delays=, transportid
    the delivery agent's service name, node the logging host.

    Sluice's own mail log (``logging.maillog``, sluice.logs) has the same
    lines under the program name ``sluice/...``; it is read the same way.

    Both time stamp forms are read: the traditional ``Nov 22 10:00:00``
    (optionally with microseconds, as postlogd writes them) and RFC 3339
    (``2026-11-22T10:00:00.123456+00:00``).  Traditional stamps have no year
    and no zone: ``year`` (default: this year, and last year for stamps
    that would lie more than a day in the future) and ``tz`` say which.

LIMITATIONS
    Postfix logs the sender at qmgr time; a message whose qmgr line is not
    in the input (the log starts later) gets an empty sender and size 0.
    Queue ids are unique per host only while Postfix's queue holds them;
    long-running logs should be split by period, or use long queue ids
    (enable_long_queue_ids = yes).

SEE ALSO
    postfix(1) logging, sluice.accounting (the event contract)
"""

from __future__ import annotations

from datetime import UTC, datetime

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from sluice.pipeline.schema import EVENT_SCHEMA

__all__ = ["maillog_events", "parse_lines"]

_SYSLOG = (
    r"^(?:(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?)"
    r"|([A-Z][a-z]{2} +\d{1,2} \d\d:\d\d:\d\d)(\.\d+)?)"
    r" +(\S+) +([^\[: ]+)(?:\[(\d+)\])?: +(.*)$"
)
_QUEUE_ID = r"^([0-9A-F]{6,20}|(?=[0-9A-Za-z]*[0-9])[0-9A-Za-z]{10,20}): +(.*)$"


def _try(col: Column, type_name: str) -> Column:
    # A cast that yields null instead of failing the job under ANSI mode.
    return col.try_cast(type_name)


def _nonempty(col: Column) -> Column:
    return F.when(col != "", col)


def parse_lines(
    lines: DataFrame, year: int | None = None, tz: str = "UTC", now: datetime | None = None
) -> DataFrame:
    """Text lines (``value``) -> time, host, program, service, pid, queue_id, text.

    Lines that are not syslog records, or carry no queue id, are dropped.
    """
    current = now or datetime.now(UTC)
    the_year = year if year is not None else current.year
    v = F.col("value")
    iso = _nonempty(F.regexp_extract(v, _SYSLOG, 1))
    trad = _nonempty(F.regexp_extract(v, _SYSLOG, 2))
    frac = F.regexp_extract(v, _SYSLOG, 3)
    message = F.regexp_extract(v, _SYSLOG, 7)
    trad_text = F.concat_ws(" ", F.lit(str(the_year)), F.regexp_replace(trad, " +", " "))
    trad_local = F.try_to_timestamp(trad_text, F.lit("yyyy MMM d HH:mm:ss"))
    frac_us = F.coalesce(
        (_try(F.concat(F.lit("0"), frac), "double") * 1_000_000).cast("long"), F.lit(0)
    )
    trad_ts = F.timestamp_micros(F.unix_micros(F.to_utc_timestamp(trad_local, tz)) + frac_us)
    limit = datetime.fromtimestamp(current.timestamp() + 86400, UTC)
    # A December line read in January: it belongs to last year.
    trad_ts = F.when(
        F.lit(year is None) & (trad_ts > F.lit(limit)),
        F.timestamp_add("YEAR", F.lit(-1), trad_ts),
    ).otherwise(trad_ts)
    time = F.when(iso.isNotNull(), F.try_to_timestamp(iso)).otherwise(trad_ts)
    program = F.regexp_extract(v, _SYSLOG, 5)
    records = lines.select(
        time.alias("time"),
        F.regexp_extract(v, _SYSLOG, 4).alias("host"),
        program.alias("program"),
        F.regexp_extract(program, r"([^/]+)$", 1).alias("service"),
        message.alias("message"),
    ).where(
        F.col("time").isNotNull()
        & (F.col("program").startswith("postfix") | F.col("program").startswith("sluice/"))
    )
    return records.select(
        "time",
        "host",
        "program",
        "service",
        F.regexp_extract("message", _QUEUE_ID, 1).alias("queue_id"),
        F.regexp_extract("message", _QUEUE_ID, 2).alias("text"),
    ).where(F.col("queue_id") != "")


def _field(pattern: str, group: int = 1) -> Column:
    return _nonempty(F.regexp_extract(F.col("text"), pattern, group))


def _deliveries(records: DataFrame) -> DataFrame:
    lines = records.where(
        F.col("text").rlike(r"^to=<") & F.col("text").rlike(r", status=(sent|deferred|bounced)")
    )
    detail = _field(r", status=\w+ \((.*)\)$")
    said = F.regexp_replace(detail, r"^host \S+ said: ", "")
    code = _try(_nonempty(F.regexp_extract(said, r"^(\d{3})[ -]", 1)), "int")
    text = F.regexp_replace(said, r"^\d{3}[ -](\d\.\d{1,3}\.\d{1,3} )?", "")
    text = F.regexp_replace(text, r" \(in reply to [^)]*\)$", "")
    relay = _field(r", relay=([^,\s]+)")
    delays = F.split(F.coalesce(_field(r", delays=([\d./]+)"), F.lit("")), "/")
    status = _field(r", status=(\w+)")
    return lines.select(
        "time",
        "host",
        "service",
        "queue_id",
        F.lower(_field(r"^to=<([^>]*)>")).alias("recipient"),
        F.when(status == "sent", "delivered").otherwise(status).alias("event"),
        F.when(relay != "none", _nonempty(F.regexp_extract(relay, r"^([^\[]+)", 1))).alias(
            "remotemx"
        ),
        F.when(relay != "none", _nonempty(F.regexp_extract(relay, r"\[([^\]]+)\]", 1))).alias(
            "remoteip"
        ),
        _try(_field(r", delay=([\d.]+)"), "double").alias("queue_age_s"),
        (
            _try(F.get(delays, 2), "double") + _try(F.get(delays, 3), "double")
        ).alias("duration_s"),
        code.alias("code"),
        _field(r", dsn=(\d\.\d{1,3}\.\d{1,3})").alias("enhanced"),
        F.when(detail.isNotNull(), text).alias("response"),
    )


def maillog_events(records: DataFrame) -> DataFrame:
    """parse_lines() records -> EVENT_SCHEMA events."""
    msg = ["host", "queue_id"]
    arrival = (
        records.where(F.col("text").rlike(r"^(client=|uid=|message-id=|sender=)"))
        .groupBy(*msg)
        .agg(F.min("time").alias("arrived_at"))
    )
    qmgr = records.where(F.col("text").rlike(r"^from=<[^>]*>, size=\d+"))
    envelope = qmgr.groupBy(*msg).agg(
        F.min_by(_field(r"^from=<([^>]*)>"), F.col("time")).alias("sender"),
        F.min_by(_try(_field(r", size=(\d+)"), "long"), F.col("time")).alias("size"),
        F.min("time").alias("queued_at"),
    )
    deliveries = _deliveries(records)
    per_rcpt = Window.partitionBy("host", "queue_id", "recipient").orderBy("time")
    deliveries = deliveries.withColumn("attempt", F.row_number().over(per_rcpt))

    # Recipients numbered by first appearance: QUEUEID-0, QUEUEID-1, ...
    firsts = deliveries.groupBy(*msg, "recipient").agg(
        F.min("time").alias("_first"),
        F.min_by(F.col("time") - F.make_interval(secs=F.col("queue_age_s")), F.col("time"))
        .alias("_guess_arrival"),
    )
    numbered = firsts.withColumn(
        "idx",
        F.row_number().over(Window.partitionBy(*msg).orderBy("_first", "recipient")) - 1,
    )

    last_status = Window.partitionBy(*msg, "recipient").orderBy(F.col("time").desc())
    last = (
        deliveries.withColumn("_n", F.row_number().over(last_status))
        .where(F.col("_n") == 1)
        .drop("_n")
    )
    expired_at = (
        records.where(F.col("text").rlike(r"status=expired"))
        .groupBy(*msg)
        .agg(F.min("time").alias("expired_at"))
    )
    expired = (
        last.where(F.col("event") == "deferred")
        .join(expired_at, msg)
        .where(F.col("expired_at") >= F.col("time"))
        .withColumn("time", F.col("expired_at"))
        .withColumn("event", F.lit("expired"))
        .withColumn("duration_s", F.lit(None).cast("double"))
        .drop("expired_at")
    )
    ndr_at = (
        records.where(F.col("text").rlike(r"^sender non-delivery notification: "))
        .groupBy(*msg)
        .agg(F.min("time").alias("ndr_at"))
    )
    failed = last.where(F.col("event") == "bounced").unionByName(expired)
    ndr = (
        failed.join(ndr_at, msg)
        .withColumn("time", F.col("ndr_at"))
        .withColumn("event", F.lit("ndr"))
        .withColumn("duration_s", F.lit(None).cast("double"))
        .drop("ndr_at")
    )
    received = (
        numbered.join(arrival, msg, "left")
        .select(
            *msg,
            "recipient",
            F.coalesce("arrived_at", "_guess_arrival", "_first").alias("time"),
            F.lit("received").alias("event"),
            F.lit(None).cast("string").alias("service"),
            F.lit(None).cast("string").alias("remotemx"),
            F.lit(None).cast("string").alias("remoteip"),
            F.lit(0.0).alias("queue_age_s"),
            F.lit(None).cast("double").alias("duration_s"),
            F.lit(None).cast("int").alias("code"),
            F.lit(None).cast("string").alias("enhanced"),
            F.lit(None).cast("string").alias("response"),
            F.lit(0).alias("attempt"),
        )
    )
    everything = (
        deliveries.unionByName(expired)
        .unionByName(ndr)
        .unionByName(received)
        .join(numbered.select(*msg, "recipient", "idx"), [*msg, "recipient"], "left")
        .join(envelope, msg, "left")
    )
    sender = F.coalesce(F.col("sender"), F.lit(""))
    values = {
        "time": F.col("time"),
        "event": F.col("event"),
        "node": F.col("host"),
        "qid": F.concat_ws("-", F.col("queue_id"), F.col("idx").cast("string")),
        "spid": F.col("queue_id"),
        "sender": sender,
        "recipient": F.col("recipient"),
        "domain": F.lower(F.regexp_extract(F.col("recipient"), r"@([^@]*)$", 1)),
        "tenantid": F.lit(""),
        "jobid": F.lit(""),
        "transportid": F.coalesce(F.col("service"), F.lit("")),
        "localip": F.lit(None),
        "remotemx": F.col("remotemx"),
        "remoteip": F.col("remoteip"),
        "attempt": F.col("attempt"),
        "code": F.col("code"),
        "enhanced": F.col("enhanced"),
        "response": F.col("response"),
        "queue_age_s": F.col("queue_age_s"),
        "size": F.coalesce(F.col("size"), F.lit(0)),
        "duration_s": F.col("duration_s"),
        "is_report": sender == "",
    }
    # What a mail log does not say (the SMTP session's context) is null.
    return everything.select(
        *[values.get(f.name, F.lit(None)).cast(f.dataType).alias(f.name)
          for f in EVENT_SCHEMA.fields]
    )
