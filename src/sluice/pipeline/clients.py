"""Who sent the mail: received recipients and SMTP connections grouped by client.

SUMMARY
    clients(events) -> DataFrame    client_ip, auth_user, tls_protocol, CLIENT_MEASURES

DESCRIPTION
    A ``received`` line of a message that came in over SMTP carries the
    session's context (client_ip, helo, tls_protocol, tls_cipher,
    auth_user), and every SMTP connection ends with a ``session`` line
    that adds what it was refused (sluice.accounting).  Grouped by the
    client's address, the AUTH user and the TLS protocol, they say who
    sends how much, whether over TLS, and who keeps failing AUTH or the
    TLS handshake.  Mail that came in otherwise (HTTP, sendmail, NDRs)
    has no client_ip and is left out.

    connections   session lines: connections that ended
    auth_failures failed AUTH attempts
    tls_failures  connections whose TLS handshake failed
    messages      distinct messages received
    recipients    recipients received

SEE ALSO
    sluice.smtpd.tally (the session line), sluice.pipeline.jobs (the
    report's ``clients`` table), docs/analytics.md
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

__all__ = ["CLIENT_COLUMNS", "CLIENT_EVENTS", "CLIENT_KEYS", "CLIENT_MEASURES", "clients"]

#: The event kinds clients() reads, and the columns it reads of them.
CLIENT_EVENTS: tuple[str, ...] = ("received", "session")
CLIENT_KEYS: tuple[str, ...] = ("client_ip", "auth_user", "tls_protocol")
CLIENT_COLUMNS: tuple[str, ...] = (*CLIENT_KEYS, "spid", "auth_failures", "tls_failure")
CLIENT_MEASURES: tuple[str, ...] = ("connections", "auth_failures", "tls_failures",
                                    "messages", "recipients")


def clients(events: DataFrame) -> DataFrame:
    """EVENT_SCHEMA -> CLIENT_KEYS, CLIENT_MEASURES, largest senders first."""
    session = F.col("event") == "session"
    received = F.col("event") == "received"
    rows = events.where(F.col("event").isin(*CLIENT_EVENTS) & F.col("client_ip").isNotNull())
    return rows.groupBy(*CLIENT_KEYS).agg(
        F.count_if(session).cast("long").alias("connections"),
        F.coalesce(F.sum(F.when(session, F.col("auth_failures"))), F.lit(0))
        .cast("long").alias("auth_failures"),
        F.count_if(session & F.col("tls_failure").isNotNull()).cast("long")
        .alias("tls_failures"),
        F.count_distinct(F.when(received, F.col("spid"))).cast("long").alias("messages"),
        F.count_if(received).cast("long").alias("recipients"),
    ).orderBy(F.col("recipients").desc(), F.col("connections").desc(), *CLIENT_KEYS)
