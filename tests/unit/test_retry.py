"""Retry math: schedules, exponential backoff, granularity, expiry (pure)."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sluice.retry import RetryPolicy

pytestmark = pytest.mark.unit

H = 3600.0
M = 60.0


def test_schedule_follows_retry_delays_and_repeats_the_last() -> None:
    p = RetryPolicy(delays_s=(30 * M, 2 * H, 4 * H), granularity_s=0)
    assert [p.delay_s(n, 0) for n in range(1, 7)] == [30 * M, 2 * H, 4 * H, 4 * H, 4 * H, 4 * H]


def test_next_attempt_is_rounded_up_to_the_granularity_grid() -> None:
    p = RetryPolicy(delays_s=(30 * M,), granularity_s=15 * M)
    now = 1_000_000.0  # not on the 15-minute grid
    at = p.next_attempt_at(now, 1, arrival_at=now)
    assert at is not None
    assert at % (15 * M) == 0
    assert now + 30 * M <= at < now + 45 * M


def test_a_time_on_the_grid_is_not_pushed_further() -> None:
    p = RetryPolicy(delays_s=(30 * M,), granularity_s=15 * M)
    now = 900.0 * 1000  # on the grid
    assert p.next_attempt_at(now, 1, arrival_at=now) == now + 30 * M


def test_granularity_is_silently_reduced_to_half_the_first_delay() -> None:
    p = RetryPolicy(delays_s=(10 * M, 1 * H), granularity_s=15 * M)
    assert p.granularity_s == 5 * M


def test_exponential_mode_doubles_with_the_age_of_the_message() -> None:
    p = RetryPolicy(mode="exponential", minimal_backoff_s=300, maximal_backoff_s=4000,
                    granularity_s=0)
    arrival = 0.0
    assert p.delay_s(1, 0) == 300  # first failure: minimal backoff
    assert p.delay_s(2, 300) == 300  # age 300 -> wait 300 (time between attempts doubles)
    assert p.delay_s(3, 600) == 600
    assert p.delay_s(4, 1200) == 1200
    assert p.delay_s(5, 2400) == 2400
    assert p.delay_s(6, 4800) == 4000  # clamped to maximal backoff
    # Following it through: attempts at 0, 300, 600, 1200, 2400, 4800, 8800
    now, times = arrival, [arrival]
    for failures in range(1, 7):
        at = p.next_attempt_at(now, failures, arrival)
        assert at is not None
        now = at
        times.append(now)
    assert times == [0, 300, 600, 1200, 2400, 4800, 8800]


def test_expiry_bounces_past_retry_maxtime_and_reports_sooner() -> None:
    p = RetryPolicy(maxtime_s=72 * H, maxtime_reports_s=24 * H, granularity_s=0)
    assert p.next_attempt_at(72 * H, 5, arrival_at=0) is None
    assert p.next_attempt_at(72 * H - 1, 5, arrival_at=0) is not None
    assert p.next_attempt_at(24 * H, 2, arrival_at=0, is_report=True) is None
    assert p.is_expired(24 * H, 0, is_report=True)
    assert not p.is_expired(24 * H, 0, is_report=False)


def test_the_last_attempt_is_made_at_the_deadline_not_skipped() -> None:
    p = RetryPolicy(delays_s=(4 * H,), maxtime_s=5 * H, granularity_s=0)
    at = p.next_attempt_at(2 * H, 2, arrival_at=0)
    assert at == 5 * H  # 2h + 4h would be 6h: clamp to the 5h deadline


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"delays_s": ()}, "non-empty"),
        ({"delays_s": (0.0,)}, "positive"),
        ({"mode": "fibonacci"}, "unknown retry mode"),
        ({"minimal_backoff_s": 10, "maximal_backoff_s": 5}, "minimal_backoff"),
    ],
)
def test_misuse_is_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


@given(
    delays=st.lists(st.floats(min_value=1, max_value=1e6), min_size=1, max_size=5),
    granularity=st.floats(min_value=0, max_value=1e5),
    now=st.floats(min_value=0, max_value=1e9),
    failures=st.integers(min_value=1, max_value=50),
    age=st.floats(min_value=0, max_value=1e6),
)
# Found in CI: 10 us past a grid line was rounded down to it (an epsilon of 1e-9
# on the quotient, 2.0000000005 here).
@example(delays=[20000.0], granularity=10000.0, now=1e-05, failures=1, age=0.0)
def test_next_attempt_is_never_early_and_rounding_adds_less_than_a_step(
    delays: list[float], granularity: float, now: float, failures: int, age: float
) -> None:
    p = RetryPolicy(delays_s=tuple(delays), granularity_s=granularity, maxtime_s=1e12)
    at = p.next_attempt_at(now, failures, arrival_at=now - age)
    assert at is not None
    wait = p.delay_s(failures, age)
    assert at >= now + wait - 1e-6 * max(1.0, now)
    assert at < now + wait + p.granularity_s + 1e-6 * max(1.0, now) + 1e-9
    assert p.granularity_s <= delays[0] / 2
