"""A part's run of failures: one warning, reminders by the clock, a back-off, one line at the end.

sluice.runtime.parts.Trouble with a fake clock: time moves only when the
test says so.  (The supervision of real parts is in
tests/integration/test_runtime_parts.py.)
"""

from __future__ import annotations

import logging

import pytest

from sluice.runtime.parts import Backoff, Health, PartFailed, describe
from sluice.store import StorageError

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def health() -> tuple[Health, Clock]:
    clock = Clock()
    return Health(backoff=Backoff(first_s=0.05, max_s=30.0), remind_s=60.0, clock=clock,
                  wall=lambda: 1_800_000_000.0 + clock.t), clock


def test_backoff_doubles_up_to_its_limit() -> None:
    b = Backoff(first_s=0.05, max_s=30.0)
    assert [b.delay_s(n) for n in (0, 1, 2, 3, 4)] == [0.0, 0.05, 0.1, 0.2, 0.4]
    assert b.delay_s(10) == 25.6 and b.delay_s(11) == 30.0 and b.delay_s(10_000) == 30.0


def test_a_full_disk_is_one_warning_then_a_reminder_a_minute_then_one_line(
        health: tuple[Health, Clock], caplog: pytest.LogCaptureFixture) -> None:
    h, clock = health
    caplog.set_level(logging.DEBUG, logger="sluice.parts")
    trouble = h.part("claiming mail")
    full = StorageError("queue commit failed: No space left on device")
    delays = []
    # Twenty minutes of failures, retried as the back-off says.
    while clock.t < 1000.0 + 20 * 60:
        delays.append(trouble.failed(full))
        clock.t += delays[-1]
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == ("claiming mail failed: queue commit failed: No space left on "
                           "device; retrying with a back-off (a reminder every 60 s while it "
                           "fails)")
    reminders = messages[1:]
    assert 18 <= len(reminders) <= 20  # one a minute, not one per attempt
    assert all(m.startswith("claiming mail still failing: ") for m in reminders)
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in caplog.records)
    assert delays[:4] == [0.05, 0.1, 0.2, 0.4] and max(delays) == 30.0
    assert len(delays) < 60  # backed off: some 50 tries in 20 minutes, not 24,000
    assert trouble.failing and trouble.failing_since_at == 1_800_000_000.0 + 1000.0
    assert trouble.storage and trouble.errors_total == len(delays)
    caplog.clear()
    trouble.ok()
    assert [r.getMessage() for r in caplog.records] == [
        f"claiming mail works again after {len(delays)} failures in {clock.t - 1000:.0f} s"]
    assert not trouble.failing and trouble.failing_since_at is None
    trouble.ok()  # working: nothing more to say
    assert len(caplog.records) == 1
    assert trouble.failed(full) == 0.05  # a new run starts from the first delay


def test_a_bug_is_logged_with_its_traceback_once(health: tuple[Health, Clock],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    h, clock = health
    trouble = h.part("expiry sweep")
    try:
        raise KeyError("spid")
    except KeyError as exc:
        for _ in range(5):
            trouble.failed(exc)
            clock.t += 1
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert record.getMessage() == "expiry sweep failed: KeyError: 'spid'; retrying with a back-off"
    assert not trouble.storage


def test_health_keeps_one_trouble_per_part(health: tuple[Health, Clock]) -> None:
    h, _ = health
    assert h.part("a") is h.part("a") and h.part("a") is not h.part("b")
    assert [p.name for p in h.parts()] == ["a", "b"]


def test_a_failure_is_one_line() -> None:
    assert describe(StorageError("disk full\nmore")) == "disk full"
    assert describe(ValueError()) == "ValueError"
    assert str(PartFailed("queue manager", RuntimeError("x"))) == \
        "queue manager failed: RuntimeError: x"
