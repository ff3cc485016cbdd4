"""The accounting log's files: one per UTC hour (or day), lines appended."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.accounting import AccountingLog

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
