"""Postfix maillogs as accounting events: inline lines, then a real Postfix run."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime

import pytest

from sluice.pipeline.maillog import maillog_events, parse_lines
from sluice.pipeline.report import Level, level, outcomes
from sluice.pipeline.schema import EVENT_SCHEMA
from tests.postfix_run import postfix_instance, postfix_missing
from tests.spark.frames import shape

pytestmark = pytest.mark.spark

LINES = [
    "Nov 20 10:00:00 mx1 postfix/smtpd[100]: 3F2A41C0D2A: client=unknown[192.0.2.9]",
    "Nov 20 10:00:00 mx1 postfix/cleanup[101]: 3F2A41C0D2A: message-id=<m1@shop.test>",
    "Nov 20 10:00:01 mx1 postfix/qmgr[102]: 3F2A41C0D2A: from=<news@shop.test>, size=1234, "
    "nrcpt=2 (queue active)",
    "Nov 20 10:00:02 mx1 postfix/smtp[103]: 3F2A41C0D2A: to=<Bob@Example.com>, "
    "relay=mx.example.com[203.0.113.5]:25, delay=2.5, delays=1/0.5/0.5/0.5, dsn=2.0.0, "
    "status=sent (250 2.0.0 Ok: queued as 99AA)",
    "Nov 20 10:00:02 mx1 postfix/smtp[103]: 3F2A41C0D2A: to=<gone@example.com>, "
    "relay=mx.example.com[203.0.113.5]:25, delay=2.5, delays=1/0.5/0.5/0.5, dsn=5.1.1, "
    "status=bounced (host mx.example.com[203.0.113.5] said: 550 5.1.1 <gone@example.com>: "
    "User unknown (in reply to RCPT TO command))",
    "Nov 20 10:00:03 mx1 postfix/bounce[104]: 3F2A41C0D2A: sender non-delivery notification: "
    "4B1C2D3E4F5",
    "Nov 20 10:00:03 mx1 postfix/qmgr[102]: 3F2A41C0D2A: removed",
    "2026-11-20T11:00:00.250000+01:00 mx2 postfix/qmgr[7]: 5D6E7F8A9B: from=<>, size=99, "
    "nrcpt=1 (queue active)",
    "2026-11-20T11:00:00.500000+01:00 mx2 postfix/smtp[8]: 5D6E7F8A9B: to=<a@slow.example>, "
    "relay=none, delay=0.3, delays=0.2/0/0.1/0, dsn=4.4.1, status=deferred (connect to "
    "mx.slow.example[198.51.100.1]:25: Connection refused)",
    "Nov 20 10:00:04 mx1 postfix/anvil[9]: statistics: max connection rate 1/60s",
    "Nov 20 10:00:04 mx1 kernel: something else entirely",
    "garbage",
]


def test_parse_inline_lines(spark):
    lines = spark.createDataFrame([(line,) for line in LINES], "value string")
    events = maillog_events(parse_lines(lines, year=2026))
    assert shape(events.schema) == shape(EVENT_SCHEMA)
    rows = {(r.event, r.recipient): r.asDict() for r in events.collect()}
    assert sorted(rows) == sorted([
        ("received", "bob@example.com"), ("delivered", "bob@example.com"),
        ("received", "gone@example.com"), ("bounced", "gone@example.com"),
        ("ndr", "gone@example.com"),
        ("received", "a@slow.example"), ("deferred", "a@slow.example"),
    ])
    ok = rows[("delivered", "bob@example.com")]
    assert ok["time"].astimezone(UTC) == datetime(2026, 11, 20, 10, 0, 2, tzinfo=UTC)
    assert (ok["node"], ok["spid"], ok["sender"], ok["size"]) == (
        "mx1", "3F2A41C0D2A", "news@shop.test", 1234)
    assert (ok["remotemx"], ok["remoteip"], ok["code"], ok["enhanced"]) == (
        "mx.example.com", "203.0.113.5", 250, "2.0.0")
    assert ok["response"] == "Ok: queued as 99AA"
    assert ok["queue_age_s"] == pytest.approx(2.5)
    assert ok["duration_s"] == pytest.approx(1.0)
    assert (ok["transportid"], ok["attempt"], ok["domain"]) == ("smtp", 1, "example.com")
    gone = rows[("bounced", "gone@example.com")]
    assert (gone["code"], gone["enhanced"], gone["response"]) == (
        550, "5.1.1", "<gone@example.com>: User unknown")
    qids = {rows[("received", r)]["qid"] for r in ("bob@example.com", "gone@example.com")}
    assert qids == {"3F2A41C0D2A-0", "3F2A41C0D2A-1"}
    assert rows[("received", "bob@example.com")]["time"].astimezone(UTC) == datetime(
        2026, 11, 20, 10, 0, 0, tzinfo=UTC)
    slow = rows[("deferred", "a@slow.example")]
    assert slow["time"].astimezone(UTC) == datetime(2026, 11, 20, 10, 0, 0, 500000, tzinfo=UTC)
    assert (slow["code"], slow["enhanced"], slow["remotemx"]) == (None, "4.4.1", None)
    assert slow["is_report"] is True and slow["sender"] == ""


def test_traditional_stamps_take_a_zone(spark):
    lines = spark.createDataFrame([(LINES[3],)], "value string")
    rec = parse_lines(lines, year=2026, tz="Europe/Berlin").collect()[0]
    assert rec.time.astimezone(UTC) == datetime(2026, 11, 20, 9, 0, 2, tzinfo=UTC)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(postfix_missing() is not None, reason=str(postfix_missing()))
def test_real_postfix_maillog(spark, tmp_path):
    with postfix_instance() as pf:
        pf.send("news@shop.test", ["ok1@ok.test", "bad1@ok.test"], "two recipients")
        pf.send("news@shop.test", ["full1@ok.test"], "mailbox full: deferred, then expired")
        pf.send("news@shop.test", ["x@dead.test"], "nobody listens: deferred, then expired")
        pf.send("news@shop.test", ["ok2@ok.test"], "plain")
        # Usually done in ~5 s.  When qmgr's queue scan meets a file whose
        # delivery agent still holds its lock, it logs "skipped, still being
        # delivered" and parks the file for 60 s (qmgr_active_defer(...,
        # 60) in Postfix's qmgr_active.c), so the wait must outlast that.
        pf.wait_for(lambda text: text.count("status=expired") == 2
                    and text.count("sender non-delivery notification") == 3
                    and pf.queue_is_empty(), timeout_s=150)
        sink = list(pf.sink.accepted)
        log = tmp_path / "maillog"
        log.write_bytes(pf.maillog.read_bytes())

    from sluice.pipeline.extract import read_lines

    events = maillog_events(parse_lines(read_lines(spark, [str(log)]))).cache()
    got = Counter((r.event, r.recipient) for r in events.collect())
    sunk = Counter(rcpt for _, rcpts in sink for rcpt in rcpts)
    delivered = Counter(r for (e, r), n in got.items() if e == "delivered" for _ in range(n))
    # Every delivery Postfix logged is one the sink took, and the other way round.
    assert delivered == sunk
    assert sunk["news@shop.test"] == 3  # three NDRs
    assert got[("bounced", "bad1@ok.test")] == 1
    assert got[("expired", "full1@ok.test")] == 1 and got[("expired", "x@dead.test")] == 1
    assert got[("deferred", "full1@ok.test")] >= 2 and got[("deferred", "x@dead.test")] >= 2
    assert {r for (e, r) in got if e == "ndr"} == {"bad1@ok.test", "full1@ok.test",
                                                   "x@dead.test"}
    received = {r for (e, r) in got if e == "received"}
    assert received == {"ok1@ok.test", "bad1@ok.test", "full1@ok.test", "x@dead.test",
                        "ok2@ok.test", "news@shop.test"}
    # The report over Postfix's events: totals equal what the sink received.
    total = level(outcomes(events), Level.TOTAL).collect()[0]
    assert total.delivered == sum(sunk.values())
    assert (total.bounced, total.expired) == (1, 2)
    events.unpersist()
