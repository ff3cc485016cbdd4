"""Sluice's mail log (sluice.logs) read back by the maillog import: the same
events come out as went in."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from sluice.accounting import EventKind, make_event
from sluice.logs import maillog_line
from sluice.model import QueueEntry, QueueState, Reply
from sluice.pipeline.maillog import maillog_events, parse_lines

pytestmark = pytest.mark.spark

AT = datetime(2026, 11, 20, 10, 0, tzinfo=UTC).timestamp()


def _entry(spid: str, idx: int, rcpt: str) -> QueueEntry:
    return QueueEntry(spid=spid, idx=idx, sender="news@shop.test", recipient=rcpt,
                      state=QueueState.INCOMING, arrival_at=AT, next_attempt_at=AT, size=2048)


def test_mail_log_round_trips_through_the_maillog_import(spark):
    hop = {"remotemx": "mx.example.com", "remoteip": "203.0.113.5", "duration_s": 0.5}
    a = _entry("019A2B3C4D5E6F70", 0, "a@example.com")
    b = _entry("019A2B3C4D5E6F70", 1, "b@example.com")
    c = _entry("019A2B3C4D5E6F71", 0, "c@slow.example")
    events = [
        make_event(EventKind.RECEIVED, a, AT),
        make_event(EventKind.RECEIVED, b, AT),
        make_event(EventKind.RECEIVED, c, AT),
        make_event(EventKind.DELIVERED, a, AT + 2, attempt=1,
                   reply=Reply(250, "2.0.0", "Ok: queued as 99AA"), **hop),  # type: ignore[arg-type]
        make_event(EventKind.DEFERRED, b, AT + 2, attempt=1,
                   reply=Reply(451, "4.7.1", "greylisted, try later"), **hop),  # type: ignore[arg-type]
        make_event(EventKind.BOUNCED, b, AT + 600, attempt=2,
                   reply=Reply(550, "5.1.1", "<b@example.com>: User unknown"), **hop),  # type: ignore[arg-type]
        make_event(EventKind.NDR, b, AT + 601),
        make_event(EventKind.DEFERRED, c, AT + 3, attempt=1,
                   reply=Reply(451, "4.4.1", "connect to mx.slow.example: Connection refused")),
        make_event(EventKind.EXPIRED, c, AT + 7200, attempt=1),
    ]
    lines = [line for e in events if (line := maillog_line(e, host="mx1", pid=42)) is not None]
    assert len(lines) == len(events)
    frame = spark.createDataFrame([(line,) for line in lines], "value string")
    out = maillog_events(parse_lines(frame, year=2026)).collect()

    def key(e: dict[str, object]) -> tuple[object, ...]:
        return (e["event"], e["spid"], e["recipient"])

    assert sorted(key(r.asDict()) for r in out) == sorted(key(e) for e in events)
    rows = {key(r.asDict()): r.asDict() for r in out}
    for e in events:
        got = rows[key(e)]
        assert got["sender"] == "news@shop.test" and got["size"] == 2048
        assert got["time"].timestamp() == pytest.approx(
            datetime.fromisoformat(e["time"].replace("Z", "+00:00")).timestamp())
        if e["event"] in ("delivered", "deferred", "bounced"):
            assert (got["code"], got["enhanced"]) == (e["code"], e["enhanced"])
            assert got["response"] == e["response"]
            assert got["queue_age_s"] == pytest.approx(e["queue_age_s"], abs=0.01)
            if e["remotemx"]:
                assert (got["remotemx"], got["remoteip"]) == (e["remotemx"], e["remoteip"])
