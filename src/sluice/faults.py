"""Fault injection: die by SIGKILL at a named point of the code, for crash tests.

SUMMARY
    SLUICE_FAULT=after_reply:3 sluice serve ...
    faults.point("after_reply")     (in the code, where a crash is to be tried)

DESCRIPTION
    The environment variable SLUICE_FAULT names one point and, after a
    colon, which pass through it kills the process (1 when left out).
    point(name) counts the passes through the named point and, at that
    pass, sends SIGKILL to its own process: no clean-up, no flush, as a
    crash or the OOM killer would.  Tests use it to stop a delivery at a
    chosen step, not by chance (tests/integration/test_delivery_crash.py).

    The points (docs/queue.md, "What is promised"):
    before_data    the server said 354; no byte of the message sent yet
    after_dot      the message and its final dot written; no reply read
    after_reply    the replies to the dot read; the outcome not yet in the store
    after_commit   the outcome in the store

STRATEGIES
    Read once, at import.  Unset (the normal case), point() is one
    comparison against None: no cost worth measuring on any path.

LIMITATIONS
    One point at a time, in every process that inherits the variable.
"""

from __future__ import annotations

import os
import signal

__all__ = ["POINTS", "point"]

#: The points the code passes, in the order of one delivery.
POINTS = ("before_data", "after_dot", "after_reply", "after_commit")


def _parse(text: str | None) -> tuple[str, int] | None:
    if not text:
        return None
    name, _, nth = text.partition(":")
    if name not in POINTS:
        raise ValueError(f"SLUICE_FAULT: unknown point {name!r} (one of {', '.join(POINTS)})")
    return name, int(nth or 1)


_armed = _parse(os.environ.get("SLUICE_FAULT"))
_passes = 0


def point(name: str) -> None:
    """Die here by SIGKILL if SLUICE_FAULT names this point and pass."""
    global _passes
    if _armed is None or _armed[0] != name:
        return
    _passes += 1
    if _passes >= _armed[1]:
        os.kill(os.getpid(), signal.SIGKILL)
