"""Garbage collection for the long-running processes: young collections far apart.

SUMMARY
    for_serving()      in a process that serves mail until stopped

DESCRIPTION
    CPython runs a young-generation collection every 700 net container
    allocations.  A queue manager or receiving process allocates
    containers for every message (entries, events, replies, futures) and
    so collected every few messages; objects without cycles are freed by
    reference counting whatever the threshold, so spacing the
    collections out saves their scans and loses little.

STRATEGY
    A young threshold of YOUNG allocations.  Measured with
    ``bench/e2e.py --configs base --runs 1 --n 20000 --no-postfix``,
    interleaved pairs on one machine (docs/benchmarks.md): with the
    machine slow, three pairs gave 10 % less CPU per message and 12 %
    more messages per second end to end; with it fast, six pairs of this
    code against the code before gave a median of 4.6 % less CPU and
    4.8 % more messages per second, five pairs of six in its favour.
    The price is bounded: cyclic garbage (an exception's traceback, a
    cancelled task's frame) waits until YOUNG allocations have happened,
    some megabytes at most.  The older generations keep CPython's ratios.

    Only the processes of ``sluice serve`` call it (cmd_serve and each
    receiving process), not the library: a test or a short command keeps
    CPython's defaults.
"""

from __future__ import annotations

import gc

__all__ = ["YOUNG", "for_serving"]

#: Net container allocations between young collections (CPython: 700).
YOUNG = 50_000


def for_serving() -> None:
    """Space young collections YOUNG allocations apart; the older ratios as they were."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG, middle, old)
