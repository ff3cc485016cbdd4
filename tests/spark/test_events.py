"""Extract and normalisation: the accounting log as written by sluice.accounting."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from sluice.accounting import EVENT_FIELDS, AccountingLog, EventKind, make_event
from sluice.model import QueueEntry, QueueState, Reply
from sluice.pipeline.events import between, parse_when
from sluice.pipeline.extract import InputError, expand_inputs, read_events
from sluice.pipeline.schema import EVENT_SCHEMA
from tests.spark.frames import T0

pytestmark = pytest.mark.spark

AT = T0.timestamp()


def _entry(i: int, rcpt: str) -> QueueEntry:
    return QueueEntry(spid=f"{i:012X}", idx=0, sender="a@shop.test", recipient=rcpt,
                      state=QueueState.INCOMING, arrival_at=AT, next_attempt_at=AT,
                      tenantid="t1", jobid="j1", localip=("192.0.2.1", "192.0.2.2"), size=321)


def _write_log(path: Path) -> AccountingLog:
    log = AccountingLog(path, rotate="hourly")
    e1, e2 = _entry(1, "Bob@Example.COM"), _entry(2, "carol@example.org")
    log.record([
        make_event(EventKind.RECEIVED, e1, AT),
        make_event(EventKind.DEFERRED, e1, AT + 60, reply=Reply(451, "4.7.1", "slow down"),
                   attempt=1, localip="192.0.2.1", remotemx="mx.example.com",
                   remoteip="203.0.113.9", duration_s=1.25),
    ], now=AT)
    log.record([
        make_event(EventKind.DELIVERED, e1, AT + 3600, reply=Reply(250, "2.0.0", "ok"),
                   attempt=2, localip="192.0.2.1", remotemx="mx.example.com",
                   remoteip="203.0.113.9", duration_s=0.5),
        make_event(EventKind.RECEIVED, e2, AT + 3601),
    ], now=AT + 3600)
    log.close()
    return log


def test_reads_the_accounting_log_as_written(spark, tmp_path):
    log = _write_log(tmp_path / "log")
    assert len(log.files()) == 2  # hourly rotation: two files
    with log.files()[0].open("a") as fh:
        fh.write("this is not json\n")
        fh.write('{"time": "not a time", "event": "received"}\n')
    events = read_events(spark, expand_inputs([str(tmp_path / "log" / "sluice-acct-*.jsonl")]))
    assert events.schema == EVENT_SCHEMA
    rows = sorted(events.collect(), key=lambda r: (r.time, r.event))
    assert [r.event for r in rows] == ["received", "deferred", "delivered", "received"]
    first = rows[1].asDict()
    assert first["time"].astimezone(UTC) == datetime.fromtimestamp(AT + 60, UTC)
    assert first["code"] == 451 and first["enhanced"] == "4.7.1"
    assert first["duration_s"] == pytest.approx(1.25)
    assert first["domain"] == "example.com"
    assert rows[0].localip == "192.0.2.1,192.0.2.2"
    assert rows[0].code is None and rows[0].remotemx is None


def test_parquet_and_json_give_the_same_events(spark, tmp_path):
    _write_log(tmp_path / "log")
    events = read_events(spark, expand_inputs([str(tmp_path / "log" / "*.jsonl")]))
    events.write.parquet(str(tmp_path / "events.parquet"))
    again = read_events(spark, [str(tmp_path / "events.parquet")])
    assert again.schema == EVENT_SCHEMA
    assert sorted(again.collect()) == sorted(events.collect())


def test_missing_keys_and_empty_domain_are_filled(spark, tmp_path):
    line = {"time": "2026-11-20T10:00:00Z", "event": "RECEIVED", "recipient": "x@Y.test."}
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps(line) + "\n")
    row = read_events(spark, [str(path)]).collect()[0]
    assert row.event == "received"
    assert row.domain == "y.test"
    assert row.size is None


def test_between_keeps_the_half_open_window(events_df):
    from tests.spark.frames import event

    df = events_df([event("received", at=s) for s in (0, 59, 60, 3600)])
    since = datetime.fromtimestamp(AT + 59, UTC)
    until = datetime.fromtimestamp(AT + 3600, UTC)
    got = [r.time.astimezone(UTC) for r in between(df, since, until).orderBy("time").collect()]
    assert got == [datetime.fromtimestamp(AT + s, UTC) for s in (59, 60)]


def test_expand_inputs(tmp_path):
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.jsonl").write_text("")
    got = expand_inputs([str(tmp_path / "*.jsonl"), str(tmp_path / "a.jsonl"),
                         "hdfs://nn/acct/*.jsonl"])
    assert got == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "hdfs://nn/acct/*.jsonl"]
    with pytest.raises(InputError, match="matches nothing"):
        expand_inputs([str(tmp_path / "nope*")])


def test_parse_when():
    now = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
    assert parse_when("24h", now) == datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
    assert parse_when("2026-11-20", now) == datetime(2026, 11, 20, tzinfo=UTC)
    assert parse_when("2026-11-20T10:00+02:00", now) == datetime(2026, 11, 20, 8, tzinfo=UTC)
    with pytest.raises(ValueError, match="neither"):
        parse_when("2026", now)


def test_event_fields_are_the_schema():
    assert tuple(EVENT_SCHEMA.fieldNames()) == EVENT_FIELDS
