"""The in-memory last hour behind the web page's charts and destination table."""

from __future__ import annotations

import pytest

from sluice.api.activity import HOUR_S, MAX_DESTINATIONS, MAX_REASONS, Activity, reason_of


def deferred(domain: str, text: str, code: int = 451) -> dict[str, object]:
    return {"event": "deferred", "domain": domain, "code": code, "enhanced": "4.7.1",
            "response": text, "remotemx": f"mx.{domain}"}


def test_series_counts_per_second_and_averages_per_step() -> None:
    a = Activity()
    t0 = 1_000_000.0  # a multiple of 10
    for _ in range(3):
        a.record("delivered", {"domain": "a.example"}, t0 + 1.2)
    a.record("accepted", {}, t0 + 1.9)
    a.record("bounced", {"domain": "a.example"}, t0 + 12.0)
    points = a.series(t0 + 20.5, step_s=10, window_s=60)
    by_at = {p[0]: p[1:] for p in points}
    assert by_at[t0] == (0.1, 0.3, 0.0, 0.0)
    assert by_at[t0 + 10] == (0.0, 0.0, 0.0, 0.1)
    assert len(points) == 6 and points[-1][0] == t0 + 10
    # Per second: the step of one second shows the counts themselves.
    per_s = {p[0]: p[1:] for p in a.series(t0 + 20.5, step_s=1, window_s=60)}
    assert per_s[t0 + 1] == (1.0, 3.0, 0.0, 0.0) and per_s[t0 + 2] == (0.0,) * 4


def test_the_ring_forgets_what_is_older_than_an_hour() -> None:
    a = Activity()
    t0 = 2_000_000.0
    a.record("delivered", {"domain": "a.example"}, t0)
    # The same slot an hour later holds the new second, not the sum of both.
    a.record("delivered", {"domain": "a.example"}, t0 + HOUR_S)
    points = a.series(t0 + HOUR_S + 1, step_s=1, window_s=HOUR_S)
    assert sum(p[2] for p in points) == 1.0
    assert a.destination_counts("a.example", t0 + HOUR_S, 60) == [1, 0, 0]
    assert a.destination_counts("a.example", t0 + 2 * HOUR_S, 60) == [0, 0, 0]


def test_destination_windows_and_last_reply() -> None:
    a = Activity()
    t0 = 3_000_000.0
    a.record("delivered", {"domain": "d.example", "code": 250, "response": "ok"}, t0)
    a.record("deferred", deferred("d.example", "try later"), t0 + 600)
    a.record("deferred", deferred("d.example", "try later"), t0 + 3500)
    now = t0 + 3550
    assert a.destination_counts("d.example", now, 5) == [0, 1, 0]
    assert a.destination_counts("d.example", now, 60) == [1, 2, 0]
    dest = a.destinations["d.example"]
    assert (dest.last_reply, dest.last_host, dest.last_at) == \
        ("451 try later", "mx.d.example", t0 + 3500)


def test_reasons_are_masked_counted_and_bounded() -> None:
    assert reason_of(deferred("x", "Try again in 37 seconds <abc@x.example> 0A1B2C3D4E")) == \
        "451 4.7.1 Try again in # seconds <…> …"
    assert reason_of({"code": None, "response": ""}) == "(no reply)"
    a = Activity()
    t0 = 4_000_000.0
    for i in range(5):
        a.record("deferred", deferred("a.example", f"greylisted for {i} s"), t0 + i)
    a.record("deferred", deferred("b.example", "mailbox busy"), t0 + 5)
    assert a.top_reasons(t0 + 10, 5) == [("451 4.7.1 greylisted for # s", 5),
                                        ("451 4.7.1 mailbox busy", 1)]
    assert a.top_reasons(t0 + 10, 1) == [("451 4.7.1 greylisted for # s", 5)]
    assert a.top_reasons(t0 + 2 * HOUR_S, 5) == []
    # Full: the reason seen longest ago goes first, one still recurring stays.
    words = [f"{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}{chr(97 + i // 676)}"
             for i in range(MAX_REASONS + 10)]
    for i, word in enumerate(words):
        a.record("deferred", deferred("c.example", f"reason {word}"), t0 + 20)
        if i % 100 == 0:
            a.record("deferred", deferred("a.example", "greylisted for 9 s"), t0 + 20)
    top = dict(a.top_reasons(t0 + 30, MAX_REASONS + 100))
    assert len(top) == MAX_REASONS
    assert top["451 4.7.1 greylisted for # s"] == 5 + (MAX_REASONS + 10 + 99) // 100
    assert "451 4.7.1 mailbox busy" not in top
    assert f"451 4.7.1 reason {words[-1]}" in top and f"451 4.7.1 reason {words[0]}" not in top


def test_destinations_are_bounded_oldest_first() -> None:
    a = Activity()
    for i in range(MAX_DESTINATIONS + 5):
        a.record("delivered", {"domain": f"d{i}.example"}, 1000.0 + i)
        if i % 1000 == 0:
            a.record("delivered", {"domain": "kept.example"}, 1000.0 + i)
    assert len(a.destinations) == MAX_DESTINATIONS
    assert "kept.example" in a.destinations and "d0.example" not in a.destinations


def test_queue_samples_one_per_ten_seconds() -> None:
    a = Activity()
    t0 = 5_000_000.0
    assert a.queue_due(t0)
    a.sample_queue(t0, 7, {"deferred": 7})
    assert not a.queue_due(t0 + 9)
    a.sample_queue(t0 + 9, 99, {"deferred": 99})  # same step: ignored
    a.sample_queue(t0 + 10, 8, {"deferred": 8})
    assert [(at, n) for at, n, _ in a.queue_series(t0 + 20)] == [(t0, 7), (t0 + 10, 8)]
    assert a.queue_series(t0 + 2 * HOUR_S) == []


def test_series_refuses_a_window_beyond_the_ring() -> None:
    with pytest.raises(ValueError, match="one hour"):
        Activity().series(0.0, step_s=10, window_s=HOUR_S + 10)
