"""The accounting log's files: one per UTC hour (or day), lines appended."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.accounting import AccountingLog, make_event, session_event
from sluice.model import ClientSession, QueueEntry, QueueState, Reply

HOUR = 1_800_000_000.0 - 1_800_000_000.0 % 3600  # 2027-01-15T08:00:00Z


@pytest.mark.parametrize(("rotate", "length"), [("hourly", 3600.0), ("daily", 86400.0)])
def test_records_go_to_the_file_of_their_period(tmp_path: Path, rotate: str,
                                                length: float) -> None:
    start = HOUR - HOUR % length
    log = AccountingLog(tmp_path, rotate=rotate)
    for at in (start, start + length - 0.001, start + length, start + 0.5, start + 2 * length):
        log.record([{"event": "x", "at": at}], now=at)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted({log.filename(start), log.filename(start + length),
                            log.filename(start + 2 * length)})
    first = (tmp_path / log.filename(start)).read_text().splitlines()
    assert [json.loads(line)["at"] for line in first] == [
        start, start + length - 0.001, start + 0.5]


def test_file_names_are_utc_hours_and_days(tmp_path: Path) -> None:
    assert AccountingLog(tmp_path).filename(HOUR + 59) == "sluice-acct-20270115T08.jsonl"
    assert AccountingLog(tmp_path, rotate="daily").filename(HOUR) == "sluice-acct-20270115.jsonl"


# Text as SMTP and next hops give it: any Unicode but lone surrogates.
_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sender=_text, recipient=_text, response=_text, tenant=_text,
       age=st.floats(0, 1e9, allow_nan=False), duration=st.floats(0, 1e5, allow_nan=False),
       code=st.integers(200, 599), attempt=st.integers(0, 1000))
def test_a_line_is_the_standard_librarys_compact_json(
        tmp_path: Path, sender: str, recipient: str, response: str, tenant: str,
        age: float, duration: float, code: int, attempt: int) -> None:
    # The lines are a contract (docs/accounting.md): the fast encoder must
    # write exactly what json.dumps(separators=(",", ":"), ensure_ascii=False)
    # writes, in UTF-8, one event a line.
    now = HOUR + 1.5
    entry = QueueEntry("0000018c3a2b1c4d5e6f", 3, sender, recipient + "@example.net",
                       QueueState.ACTIVE, now - age, now, attempts=attempt, tenantid=tenant,
                       domain="example.net", size=attempt * 7)
    events = [make_event(kind, entry, now, node="n1", reply=Reply(code, "2.0.0", response),
                         remotemx="mx.example.net", duration_s=duration)
              for kind in ("delivered", "deferred")]
    events.append(session_event(
        ClientSession("192.0.2.7", tenant, "TLSv1.3", None, sender or None), now, node="n1",
        started_at=now - duration, refused={str(code): attempt}, auth_failures=attempt))
    where = Path(tempfile.mkdtemp(dir=tmp_path))  # one directory an example
    log = AccountingLog(where, node="n1")
    try:
        assert log.record(events, now=now) == 3
    finally:
        log.close()
    data = (where / log.filename(now)).read_bytes()
    compact = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
    assert data == b"".join(compact(e).encode("utf-8") + b"\n" for e in events)
    assert [json.loads(line) for line in data.splitlines()] == events


def test_what_orjson_refuses_is_written_by_the_standard_library(tmp_path: Path) -> None:
    # A HELO's bytes that were not UTF-8 arrive as surrogate escapes; an int
    # key is past orjson.  Both lines are still written, as the standard
    # library writes them, each undecodable byte as U+FFFD.
    log = AccountingLog(tmp_path)
    events = [{"event": "session", "helo": "bad\udcff\udcfe.test", "n": 1},
              {"event": "x", "refused": {550: 2}}]
    assert log.record(events, now=HOUR) == 2
    log.close()
    lines = (tmp_path / log.filename(HOUR)).read_bytes().splitlines()
    assert lines[0] == '{"event":"session","helo":"bad\ufffd\ufffd.test","n":1}'.encode()
    assert lines[1] == b'{"event":"x","refused":{"550":2}}'
