"""Several Sluice nodes as one MTA: limits shared in Redis, nodes watched in PostgreSQL.

See docs/cluster.md.  ``enabled(config)`` says whether this node is part of
a cluster (``cluster.redis`` or $SLUICE_REDIS_URL is set).
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from sluice.config import Config

__all__ = ["enabled", "one_line", "wait_stop"]


def enabled(config: Config) -> bool:
    """Whether the configuration makes this node share its limits."""
    return bool(os.environ.get("SLUICE_REDIS_URL") or config.cluster.redis)


def one_line(exc: BaseException) -> str:
    """An error as one log line: its type and the first line of its text."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


async def wait_stop(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``stop`` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
