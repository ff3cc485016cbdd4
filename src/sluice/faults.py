"""Named points of a delivery: die there by SIGKILL (crash tests) or note when it passed.

SUMMARY
    SLUICE_FAULT=after_reply:3 sluice serve ...
    SLUICE_TRACE=/tmp/points.log sluice serve ...
    faults.point("after_reply", spids)  (in the code, where a crash is to be tried)

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
    after_journal  the successes synced to the success journal (sluice.journal),
                   not yet handed to the store
    after_commit   the outcome applied in the store (sluice.runtime.recorder)

    SLUICE_TRACE names a file to which every pass through a point appends
    one line: the wall-clock time, the process id, the point's name and
    the SPIDs of the messages it concerns ("1764400000.123456 4242
    after_reply 7b1q0c..."). A crash keeps every line written before it
    (each is one write(2) to the page cache), so a harness can tell what a
    killed process had done with a message when it died:
    bench/harsh_kill.py classifies its duplicates from it.

STRATEGIES
    Read once, at import.  Unset (the normal case), point() is two
    comparisons against None: no cost worth measuring on any path.  A
    caller passes the SPIDs as a generator, only walked when tracing (its
    creation is the one cost left).  A trace that cannot be opened stops
    the start with one line; one that cannot be written is skipped.

LIMITATIONS
    One fault point at a time, in every process that inherits the
    variable.  The trace is not rotated: it is for a harness's run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable

__all__ = ["POINTS", "point"]

#: The points the code passes, in the order of one delivery.
POINTS = ("before_data", "after_dot", "after_reply", "after_journal", "after_commit")


def _parse(text: str | None) -> tuple[str, int] | None:
    if not text:
        return None
    name, _, nth = text.partition(":")
    if name not in POINTS:
        raise ValueError(f"SLUICE_FAULT: unknown point {name!r} (one of {', '.join(POINTS)})")
    return name, int(nth or 1)


def _open_trace(path: str | None) -> int | None:
    if not path:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ValueError(f"SLUICE_TRACE: cannot open {path}: {exc.strerror}") from None


_armed = _parse(os.environ.get("SLUICE_FAULT"))
_passes = 0
_trace = _open_trace(os.environ.get("SLUICE_TRACE"))


def point(name: str, spids: Iterable[str] = ()) -> None:
    """Note the pass if SLUICE_TRACE is set; die here if SLUICE_FAULT names this point and pass."""
    global _passes
    if _trace is not None:
        # One write(2) a line: lines of concurrent threads never interleave.
        # A trace that cannot be written (a full disk) must not fail a delivery.
        with contextlib.suppress(OSError):
            os.write(_trace, " ".join((f"{time.time():.6f}", str(os.getpid()), name, *spids))
                     .encode() + b"\n")
    if _armed is None or _armed[0] != name:
        return
    _passes += 1
    if _passes >= _armed[1]:
        os.kill(os.getpid(), signal.SIGKILL)
