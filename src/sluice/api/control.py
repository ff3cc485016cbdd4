"""What the API does to the queue and the scheduler: the hands every operation shares.

SUMMARY
    control = Control(config, queue, manager, audit, metrics)
    control.queue_ops   reads and actions on the queue    (sluice.api.queue_ops)
    control.views       the scheduler and the metrics     (sluice.api.views)
    control.policy_ops  suspensions, conditions, reloads  (sluice.api.policy_ops)
    control.rollbacks   undoing a change                  (sluice.api.rollback)
    control.console     headers, bodies, destinations, charts (sluice.api.console)

DESCRIPTION
    The HTTP layer (sluice.api.app and its routers) validates shapes; the
    operations check meaning, do the work, record it in the audit history
    and answer with the API's typed models (sluice.api.models).  They
    share what this module holds: the configuration, the queue, the queue
    manager (through the narrow protocol of sluice.api.ports, never the
    runtime itself), the audit history, the metrics, a clock, and a
    small thread pool for store calls, which block and so never run on
    the event loop the queue manager shares.  Scheduler views and events
    are used on the loop only: the scheduler is not thread-safe.

STRATEGIES
    One change at a time.  Policy changes and rollbacks take one lock
    (``change_lock``), so ``before`` and ``after`` of a record are never
    interleaved with another change made through the API.

INVARIANTS
    Nothing a request carries reaches the scheduler unchecked.

SEE ALSO
    sluice.api.ports, sluice.api.audit, docs/api.md
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sluice.api.audit import AuditAction, AuditLog, AuditRecord
from sluice.api.console import ConsoleOps
from sluice.api.errors import ApiError
from sluice.api.metrics import Metrics
from sluice.api.policy_ops import PolicyOps
from sluice.api.ports import Manager, SchedulerViews
from sluice.api.queue_ops import QueueOps
from sluice.api.rollback import Rollbacks
from sluice.api.views import Views
from sluice.config import Config
from sluice.model import QueueState, Selector, parse_qid
from sluice.queue import Queue
from sluice.retry import RetryPolicy
from sluice.store import StorageError

__all__ = ["ApiError", "Control"]

log = logging.getLogger("sluice.api")

T = TypeVar("T")


class Control:
    """The API's view of, and hands on, one running queue manager."""

    def __init__(self, config: Config, queue: Queue, manager: Manager, audit: AuditLog,
                 metrics: Metrics, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.queue = queue
        self.manager = manager
        self.audit = audit
        self.metrics = metrics
        self.clock = clock
        self.retry = RetryPolicy.from_config(config.queue)
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sluice-api")
        #: Taken by every policy change and rollback.
        self.change_lock = asyncio.Lock()
        self.queue_ops = QueueOps(self)
        self.views = Views(self)
        self.policy_ops = PolicyOps(self)
        self.rollbacks = Rollbacks(self)
        self.console = ConsoleOps(self)

    def close(self) -> None:
        """Wait for the API's worker threads to finish, and stop them."""
        self.pool.shutdown(wait=True)

    @property
    def scheduler(self) -> SchedulerViews:
        """The running scheduler's read-only views."""
        return self.manager.scheduler

    async def io(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Run a blocking call in the API's threads; storage trouble is a 503."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.pool, functools.partial(fn, *args, **kw))
        except StorageError as exc:
            raise ApiError(503, "storage unavailable", str(exc)) from None

    def now(self) -> float:
        """The time now, never before the scheduler's own clock."""
        return max(self.clock(), self.scheduler.now)

    # -- request parts -------------------------------------------------------------------

    @staticmethod
    def selector(qids: Iterable[str] = (), states: Iterable[QueueState] = (),
                 **fields: str | None) -> Selector:
        """A Selector from query values, queue ids upper-cased; a bad value is a 422."""
        try:
            return Selector(qids=tuple(q.strip().upper() for q in qids),
                            states=tuple(states), **fields)
        except ValueError as exc:
            raise ApiError(422, "invalid selector", [{"path": "qids", "message": str(exc)}]
                           ) from None

    @staticmethod
    def qid(text: str, *, bare_ok: bool) -> tuple[str, int | None]:
        """A queue id or SPID parsed, a bad one a 422; a bare SPID only where ``bare_ok``."""
        try:
            spid, idx = parse_qid(text)
        except ValueError as exc:
            raise ApiError(422, "invalid queue id", str(exc)) from None
        if idx is None and not bare_ok:
            raise ApiError(422, "invalid queue id", f"{text!r} is a SPID; give SPID-N")
        return spid, idx

    # -- the audit history ---------------------------------------------------------------

    async def record(self, who: str, action: AuditAction, target: str, reason: str,
                     before: Any, after: Any, *, reversible: bool,
                     rollback_of: int | None = None) -> AuditRecord:
        """Append to the audit history (fsynced) before the change is reported done."""
        return await self.audited(functools.partial(
            self.audit.append, who, action, target, reason, before, after,
            reversible=reversible, now=self.clock(), rollback_of=rollback_of))

    async def audited(self, append: Callable[[], AuditRecord]) -> AuditRecord:
        """Run an audit append in the API's threads.

        A failure is a 503 that says the change itself was applied.
        """
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, append)
        except OSError as exc:
            log.error("audit history %s not written: %s", self.audit.path, exc)
            raise ApiError(503, "audit not written",
                           f"the change was applied, but the audit history "
                           f"{self.audit.path} could not be written: {exc}") from None
