"""The queue manager's duties that poll the store: the change feed and expiry.

SUMMARY
    watcher = ChangeWatcher(store, io=..., apply=manager.apply_changes, poll_s=1.0)
    sweep = ExpirySweep(queue, recorder, io=..., interval_s=600)
    supervisor.keep("change feed watcher", watcher.run)
    supervisor.keep("expiry sweep", sweep.run)

STRATEGY
    Each is a part of its own (sluice.runtime.parts): a loop that polls,
    says it works (Trouble.ok) after each round, and is restarted after a
    back-off when it crashes.  The state they keep lives on the object, so
    a restart goes on where the crashed run stopped.

    The change feed watcher reads the store's feed of operator changes
    (changes_since) and hands the qids to the manager, which drops its
    in-memory copies and gives their claims back, so they come back
    re-read -- Halon's "re-inject".  Changes made before this start do not
    concern this run's memory: the first round only learns where the feed
    stands.

    The expiry sweep bounces deferred entries past retry_maxtime every
    queue.bounces_interval (at least 1 s), and has the recorder run NDRs
    for those and for bounces left by a crash or a failed NDR run.

SEE ALSO
    sluice.runtime.manager, sluice.runtime.parts, sluice.queue
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from sluice.model import QueueState
from sluice.queue import Queue
from sluice.runtime.parts import Trouble
from sluice.runtime.recorder import Recorder
from sluice.store import Store

__all__ = ["ChangeWatcher", "ExpirySweep"]

log = logging.getLogger("sluice.manager")


class ChangeWatcher:
    """Operator changes made to entries held here: drop and re-claim them."""

    def __init__(self, store: Store, *, io: Callable[..., Awaitable[Any]],
                 apply: Callable[[set[str]], None], poll_s: float = 1.0) -> None:
        self.store = store
        self.poll_s = poll_s
        self._io = io
        self._apply = apply
        self._seq: int | None = None

    async def run(self, trouble: Trouble) -> None:
        """Poll the change feed every ``poll_s`` and apply what it lists."""
        if self._seq is None:
            # Changes made before this start do not concern this run's memory.
            self._seq, _ = await self._io(self.store.changes_since, 0)
        while True:
            await asyncio.sleep(self.poll_s)
            seq, changes = await self._io(self.store.changes_since, self._seq)
            trouble.ok()
            self._seq = seq
            if changes:
                self._apply({c.qid for c in changes})


class ExpirySweep:
    """Deferred entries past their lifetime bounce; bounces get their NDRs."""

    def __init__(self, queue: Queue, recorder: Recorder, *,
                 io: Callable[..., Awaitable[Any]], interval_s: float) -> None:
        self.queue = queue
        self.recorder = recorder
        self.interval_s = max(1.0, interval_s)
        self._io = io

    async def run(self, trouble: Trouble) -> None:
        """Expire, then ask for an NDR run if anything waits to bounce; repeat."""
        while True:
            expired = await self._io(self.queue.expire)
            if expired:
                log.info("%d deferred entries expired", expired)
                self.recorder.bounce_soon()
            # Bounces left by a crash or a failed NDR run are picked up here too.
            if (await self._io(self.queue.store.count))[QueueState.BOUNCE]:
                self.recorder.bounce_soon()
            trouble.ok()
            await asyncio.sleep(self.interval_s)
