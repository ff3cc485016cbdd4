"""Who owns each task of `sluice serve`, and what a failure does: restart or stop.

SUMMARY
    health = Health(backoff=Backoff(...), remind_s=60.0)
    async with Supervisor(health) as parts:
        parts.keep("change feed watcher", watch)     # restarts after a crash
        parts.vital("queue manager", run)            # a crash stops the process
        ...
    trouble = health.part("claiming mail"); delay = trouble.failed(exc); trouble.ok()

DESCRIPTION
    Every task has an owner.  A Supervisor is an asyncio.TaskGroup with two
    kinds of parts:

    keep(name, run)   a part that can start again: run(trouble) is a
                      coroutine (a watcher, a sweep, a follower).  When it
                      raises, the failure is logged once with its cause and
                      the part is started again after a back-off; while it
                      keeps failing, a reminder is logged now and then.
    vital(name, run)  a part that cannot (the scheduler loop: its books
                      would be wrong).  When it raises, the failure is
                      logged once and PartFailed ends the group: every
                      other part is cancelled and the caller -- `sluice
                      serve` -- stops with one line and a non-zero status.

    On a normal exit the parts still running are cancelled one at a time,
    the last started first, each waited for: shutdown has a defined order.
    The owner may also cancel one part (cancel(task)) to order it.

    A Trouble is one part's run of failures, for parts that retry work
    themselves too (a refill that cannot claim, outcomes that cannot be
    recorded): failed(exc) logs the first failure and returns how long to
    wait before the next try; ok() ends the run with one line.  Health
    keeps every Trouble of the process, for /metrics.

STRATEGIES
    One warning, then reminders.  A failure that repeats (a full disk: the
    same StorageError on every refill) is logged at its first occurrence,
    then at most once every ``remind_s`` with the count, then once when
    the part works again -- never once per attempt.  A storage error is
    expected: one line.  Anything else is a bug: its first occurrence is
    logged with the traceback.

    Exponential back-off.  The n-th failure in a row waits first_s *
    factor^(n-1), at most max_s, before the next try; a success resets it.

LIMITATIONS
    A part that fails at once on every start is restarted for ever (with
    the back-off): a watcher that cannot read its file should not stop the
    delivery of mail.

SEE ALSO
    sluice.runtime.manager, sluice.runtime.serve, docs/serve.md, docs/design.md
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType

from sluice.store import StorageError

__all__ = ["Backoff", "Health", "PartFailed", "Supervisor", "Trouble"]

log = logging.getLogger("sluice.parts")

#: Errors of the storage (the queue's store, or the files a part reads):
#: expected on a full or failing disk, logged without a traceback.
STORAGE_ERRORS: tuple[type[BaseException], ...] = (StorageError, OSError)


@dataclass(frozen=True, slots=True)
class Backoff:
    """How long to wait after the n-th failure in a row."""

    first_s: float = 0.05
    max_s: float = 30.0
    factor: float = 2.0

    def delay_s(self, failures: int) -> float:
        """The wait after ``failures`` failures in a row: none before one, at most ``max_s``."""
        if failures <= 0:
            return 0.0
        return min(self.max_s, self.first_s * self.factor ** min(failures - 1, 64))


class PartFailed(Exception):
    """A part that cannot restart failed: the process must stop."""

    def __init__(self, part: str, cause: BaseException) -> None:
        super().__init__(f"{part} failed: {describe(cause)}")
        self.part = part
        self.cause = cause


def describe(exc: BaseException) -> str:
    """One line: the exception's type (unless it is a StorageError) and message."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, StorageError):
        return text or "storage error"
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


class Trouble:
    """One part's run of failures: what it logs, how long it waits, since when."""

    def __init__(self, name: str, health: Health) -> None:
        self.name = name
        self._health = health
        #: Failures in a row (0: working).
        self.failures = 0
        #: Failures since the process started.
        self.errors_total = 0
        #: When (POSIX time) the current run of failures began; None: working.
        self.failing_since_at: float | None = None
        self.last_error = ""
        #: Whether the last failure was the storage's (a full disk) or a bug.
        self.storage = False
        self._started_mono = 0.0
        self._reminded_mono = 0.0
        self._since_reminder = 0

    @property
    def failing(self) -> bool:
        """Whether the part's last run failed (its run of failures is not over)."""
        return self.failures > 0

    def failed(self, exc: BaseException) -> float:
        """Note a failure; returns the seconds to wait before trying again."""
        h = self._health
        now = h.clock()
        self.failures += 1
        self.errors_total += 1
        self._since_reminder += 1
        self.last_error = describe(exc)
        self.storage = isinstance(exc, STORAGE_ERRORS)
        delay = h.backoff.delay_s(self.failures)
        if self.failures == 1:
            self.failing_since_at = h.wall()
            self._started_mono = self._reminded_mono = now
            self._since_reminder = 0
            if self.storage:
                h.log.warning("%s failed: %s; retrying with a back-off (a reminder every "
                              "%g s while it fails)", self.name, self.last_error, h.remind_s)
            else:
                h.log.error("%s failed: %s; retrying with a back-off", self.name,
                            self.last_error, exc_info=exc)
        elif now - self._reminded_mono >= h.remind_s:
            h.log.warning("%s still failing: %d failures in %.0f s (%d since the last "
                          "reminder), retrying every %g s; last: %s", self.name, self.failures,
                          now - self._started_mono, self._since_reminder, delay,
                          self.last_error)
            self._reminded_mono = now
            self._since_reminder = 0
        return delay

    def ok(self) -> None:
        """The part worked: end a run of failures (one line if there was one)."""
        if not self.failures:
            return
        h = self._health
        h.log.warning("%s works again after %d failures in %.0f s", self.name, self.failures,
                      h.clock() - self._started_mono)
        self.failures = 0
        self.failing_since_at = None
        self._since_reminder = 0


class Health:
    """Every Trouble of the process, and how failures are retried and reported."""

    def __init__(self, *, backoff: Backoff | None = None, remind_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 logger: logging.Logger | None = None) -> None:
        self.backoff = backoff or Backoff()
        self.remind_s = remind_s
        self.clock = clock
        self.wall = wall
        self.log = logger or log
        self._parts: dict[str, Trouble] = {}

    def part(self, name: str) -> Trouble:
        """The Trouble of ``name`` (made on first use)."""
        trouble = self._parts.get(name)
        if trouble is None:
            trouble = self._parts[name] = Trouble(name, self)
        return trouble

    def parts(self) -> list[Trouble]:
        """Every part's Trouble, failing or not."""
        return list(self._parts.values())


class Supervisor:
    """A task group for long-lived parts: restart the ones that can, stop for the rest."""

    def __init__(self, health: Health, *,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.health = health
        self._sleep = sleep
        self._group = asyncio.TaskGroup()
        self._parts: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Supervisor:
        await self._group.__aenter__()
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if et is None:
            # Leaving normally: the parts still running stop in reverse order.
            for task in reversed(self._parts):
                await self.cancel(task)
        await self._group.__aexit__(et, exc, tb)

    def keep(self, name: str, run: Callable[[Trouble], Awaitable[None]]) -> asyncio.Task[None]:
        """Run a part that is started again, after a back-off, whenever it fails."""
        task = self._group.create_task(self._keep(self.health.part(name), run), name=name)
        self._parts.append(task)
        return task

    def vital(self, name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """Run a part whose failure ends the group with PartFailed."""
        task = self._group.create_task(self._vital(name, run), name=name)
        self._parts.append(task)
        return task

    async def cancel(self, task: asyncio.Task[None]) -> None:
        """Cancel one part and wait until it has ended."""
        if task.done():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({task})

    async def _keep(self, trouble: Trouble, run: Callable[[Trouble], Awaitable[None]]) -> None:
        while True:
            try:
                await run(trouble)
                return
            except Exception as exc:  # every failure restarts the part
                delay = trouble.failed(exc)
            await self._sleep(delay)

    async def _vital(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        try:
            await run()
        except Exception as exc:
            cause = first_cause(exc)
            log.error("%s failed: %s", name, describe(cause), exc_info=cause)
            raise PartFailed(name, cause) from cause


def first_cause(exc: BaseException) -> BaseException:
    """The first exception that is not a group (a TaskGroup wraps its children's)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
