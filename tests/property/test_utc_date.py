"""The scheduler's clock-free date formatting agrees with datetime."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.scheduler.explanation import format_at, utc_date

pytestmark = pytest.mark.property


@given(st.floats(min_value=0, max_value=253402300799, allow_nan=False))
def test_utc_date_is_datetimes(at: float) -> None:
    want = datetime.fromtimestamp(int(at // 1), UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    assert utc_date(at) == want


def test_format_at_says_a_duration_and_a_date() -> None:
    at = datetime(2026, 11, 25, 8, 30, tzinfo=UTC).timestamp()
    assert format_at(at, at - 1799.5) == "in 30m (at 2026-11-25 08:30:00 UTC)"
    assert format_at(at, at + 7265) == "2h1m ago (at 2026-11-25 08:30:00 UTC)"
