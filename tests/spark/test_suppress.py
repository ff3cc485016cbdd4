"""The suppress transform, and its list read back by the queue's reader."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from sluice.accounting import EVENT_FIELDS
from sluice.pipeline.schema import EVENT_SCHEMA, SUPPRESSION_SCHEMA
from sluice.pipeline.suppress import suppressions
from sluice.suppression import SuppressionList, SuppressionReason
from tests.spark.frames import T0, assert_df_equal, event, shape

pytestmark = pytest.mark.spark

DAY = 86400.0
FULL = {"code": 452, "enhanced": "4.2.2", "response": "mailbox full"}


def _df(spark, rows):
    return spark.createDataFrame([tuple(r[f] for f in EVENT_FIELDS) for r in rows], EVENT_SCHEMA)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_hard_and_soft_rules(spark):
    rows = [
        # hard bounce, never delivered since -> hard
        event("bounced", "<Gone@Example.com>", 10, code=550, enhanced="5.1.1",
              response="user unknown"),
        # hard bounce, then delivered -> nothing (the address works again)
        event("bounced", "back@example.com", 10, code=550, enhanced="5.1.1",
              response="user unknown"),
        event("delivered", "back@example.com", 20),
        # spam block (5xx but soft) once -> nothing
        event("bounced", "blocked@example.com", 10, code=550, enhanced="5.7.1",
              response="blocked using zen.spamhaus.org"),
        # three soft failures in a row within the window -> soft
        *[event("bounced", "full@example.com", DAY * d, **FULL) for d in (1, 2, 3)],
        # three soft failures but a delivery in between -> nothing
        event("expired", "flaky@example.com", DAY * 1, **FULL),
        event("delivered", "flaky@example.com", DAY * 1.5),
        event("expired", "flaky@example.com", DAY * 2, **FULL),
        event("expired", "flaky@example.com", DAY * 3, **FULL),
        # three soft failures, the first outside the 2.5-day window -> nothing
        *[event("bounced", "old@example.com", DAY * d, **FULL) for d in (0.2, 2, 3)],
        # deferrals are not outcomes -> nothing
        *[event("deferred", "grey@example.com", DAY * d, **FULL) for d in (1, 2, 3)],
    ]
    got = suppressions(_df(spark, rows), soft_count=3, soft_days=2.5, soft_ttl_days=10)
    assert shape(got.schema) == shape(SUPPRESSION_SCHEMA)
    expected = spark.createDataFrame(
        [
            ("full@example.com", "soft", "quota-issues", 452, "4.2.2", "mailbox full",
             _at(DAY), _at(3 * DAY), 3, _at(13 * DAY)),
            ("gone@example.com", "hard", "bad-mailbox", 550, "5.1.1", "user unknown",
             _at(10), _at(10), 1, None),
        ],
        SUPPRESSION_SCHEMA,
    )
    assert_df_equal(got, expected, checkRowOrder=True)


def test_until_bounds_the_window(spark):
    rows = [event("bounced", "full@example.com", DAY * d, **FULL) for d in (1, 2, 3)]
    until = T0 + timedelta(days=2, hours=12)  # sees only the first two
    assert suppressions(_df(spark, rows), soft_count=2, soft_days=7, until=until).count() == 1
    assert suppressions(_df(spark, rows), soft_count=3, soft_days=7, until=until).count() == 0


def test_job_writes_a_list_the_queue_reads(spark, tmp_path):
    from sluice.accounting import AccountingLog, EventKind, make_event
    from sluice.model import QueueEntry, QueueState, Reply
    from sluice.pipeline.jobs import run_suppress

    at = T0.timestamp()
    log = AccountingLog(tmp_path / "log", rotate="daily")
    entries = {
        rcpt: QueueEntry(spid=f"{i:010X}", idx=0, sender="s@shop.test", recipient=rcpt,
                         state=QueueState.ACTIVE, arrival_at=at, next_attempt_at=at)
        for i, rcpt in enumerate(["nobody@example.com", "fine@example.com"])
    }
    log.record([
        make_event(EventKind.BOUNCED, entries["nobody@example.com"], at + 5,
                   reply=Reply(550, "5.1.1", "<nobody@example.com>: no such user"),
                   remotemx="mx.example.com"),
        make_event(EventKind.DELIVERED, entries["fine@example.com"], at + 6,
                   reply=Reply(250, "2.0.0", "ok"), remotemx="mx.example.com"),
    ], now=at)
    log.close()
    target = tmp_path / "etc" / "suppression.jsonl"
    # An operator's manual entry is already there, and an entry for an
    # address that has since been delivered to.
    target.parent.mkdir()
    target.write_text(
        '{"address": "@spamtrap.example", "reason": "manual"}\n'
        '{"address": "fine@example.com", "reason": "hard", "last_at": "2026-11-19T00:00:00Z"}\n'
    )
    result = run_suppress(spark, [str(tmp_path / "log" / "*.jsonl")], str(tmp_path / "out"),
                          list_path=str(target), now=at + 10)
    assert result.counts == {"found_hard": 1, "found_soft": 0, "listed_before": 2,
                             "listed_now": 2}
    listed = SuppressionList.load(target)
    assert sorted(e.address for e in listed) == ["@spamtrap.example", "nobody@example.com"]
    entry = listed.lookup("<NoBody@Example.com>", now=at + 20)
    assert entry is not None and entry.reason is SuppressionReason.HARD
    assert entry.category == "bad-mailbox" and entry.code == 550
    reply = entry.reply("NoBody@example.com")
    assert (reply.code, reply.enhanced) == (550, "5.1.1")
    assert "nobody@example.com" in reply.text and "bounced permanently" in reply.text
    assert listed.lookup("anyone@spamtrap.example") is not None
    assert listed.lookup("fine@example.com") is None
    assert listed.generated_at == pytest.approx(at + 10, abs=0.001)
    assert (tmp_path / "out" / "suppression.csv").is_dir()
