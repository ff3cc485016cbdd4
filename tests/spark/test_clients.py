"""The SMTP session's context in the analytics: read, grouped by client, not in outcomes."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.accounting import AccountingLog, EventKind, make_event, session_event
from sluice.model import ClientSession, QueueEntry, QueueState
from sluice.pipeline.clients import clients
from sluice.pipeline.extract import expand_inputs, read_events
from sluice.pipeline.jobs import cached_events
from sluice.pipeline.report import Level, level, outcomes
from sluice.pipeline.schema import EVENT_SCHEMA
from tests.spark.frames import T0

pytestmark = pytest.mark.spark

AT = T0.timestamp()
TLS = ClientSession("192.0.2.7", "mta.sender.test", "TLSv1.3", "TLS_AES_256_GCM_SHA384",
                    "alice")
PLAIN = ClientSession("198.51.100.9", "bot.test")


def _entry(spid: str, idx: int, rcpt: str) -> QueueEntry:
    return QueueEntry(spid=spid, idx=idx, sender="a@sender.test", recipient=rcpt,
                      state=QueueState.INCOMING, arrival_at=AT, next_attempt_at=AT, size=500)


def _write(path: Path) -> None:
    log = AccountingLog(path)
    log.record([
        # alice: two messages over TLS, three recipients, one connection
        make_event(EventKind.RECEIVED, _entry("00000000000A", 0, "x@example.com"), AT,
                   client=TLS),
        make_event(EventKind.RECEIVED, _entry("00000000000A", 1, "y@example.com"), AT,
                   client=TLS),
        make_event(EventKind.RECEIVED, _entry("00000000000B", 0, "z@example.com"), AT + 1,
                   client=TLS),
        session_event(TLS, AT + 2, started_at=AT - 1, refused={"550": 1}),
        # the bot: two connections, AUTH failures and a failed handshake, no mail
        session_event(PLAIN, AT + 3, refused={"535": 3, "421": 1}, auth_failures=3),
        session_event(PLAIN, AT + 4, tls_failure="SSLError: unsupported protocol"),
        # no session context: an HTTP injection
        make_event(EventKind.RECEIVED, _entry("00000000000C", 0, "w@example.com"), AT + 5),
    ], now=AT)
    log.close()


def test_new_fields_are_read_grouped_and_kept_out_of_outcomes(spark, tmp_path):
    _write(tmp_path / "log")
    events = read_events(spark, expand_inputs([str(tmp_path / "log" / "*.jsonl")]))
    assert events.schema == EVENT_SCHEMA
    session = events.where("event = 'session' AND auth_failures = 3").first()
    assert session is not None and session.refused == {"535": 3, "421": 1}
    got = [r.asDict() for r in clients(events).collect()]
    assert got == [
        {"client_ip": "192.0.2.7", "auth_user": "alice", "tls_protocol": "TLSv1.3",
         "connections": 1, "auth_failures": 0, "tls_failures": 0, "messages": 2,
         "recipients": 3},
        {"client_ip": "198.51.100.9", "auth_user": None, "tls_protocol": None,
         "connections": 2, "auth_failures": 3, "tls_failures": 1, "messages": 0,
         "recipients": 0},
    ]
    # What the report caches keeps these columns for received and session lines.
    cached = cached_events(events, ["report"])
    assert [r.asDict() for r in clients(cached).collect()] == got
    # Sessions are connections, not recipients: no cell of their own.
    by_domain = level(outcomes(events), Level.DOMAIN).collect()
    assert [(r.domain, r.received) for r in by_domain] == [("example.com", 4)]
