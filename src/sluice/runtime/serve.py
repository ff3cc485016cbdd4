"""`sluice serve`: receive, queue and deliver in one command.

SUMMARY
    serve(config) -> exit status
    Server(config); await server.start(); ...; await server.stop()

DESCRIPTION
    One queue manager (this process) and the receivers:

    * with a store that several processes may open (SQLite, PostgreSQL),
      ``smtpd.processes`` receiving processes (default: one per core)
      share the SMTP port with SO_REUSEPORT; the queue manager learns of
      new mail by polling the store every ``poll_s`` (a read that costs
      microseconds when nothing is new);
    * otherwise (LevelDB) the receiver runs inside this process and tells
      the queue manager of each message directly.

    The queue manager holds an exclusive lock on ``<queue.path>/manager-
    <node id>.lock``, so two managers never work one queue as the same
    node.

    Signals: SIGTERM or SIGINT stop gracefully -- receivers stop accepting
    and finish the messages in DATA, in-flight deliveries finish, claims
    are given back -- and the process exits 0.  SIGHUP reloads the pickup
    policy file.  A restart resumes the queue where it was.

SEE ALSO
    sluice.runtime.manager, sluice.smtpd, docs/serve.md
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sluice.config import Config
from sluice.delivery.agent import DeliveryAgent
from sluice.delivery.router import Router
from sluice.hooks import Hooks
from sluice.logs import ready, setup_logging
from sluice.queue import Queue
from sluice.runtime.manager import QueueManager
from sluice.smtpd import Receiver, ReceiverPool, receiver_processes

__all__ = ["ServeError", "Server", "serve"]

log = logging.getLogger("sluice.serve")


class ServeError(Exception):
    """Sluice cannot start (the message says why, in one line)."""


class Server:
    """Everything `sluice serve` runs, startable and stoppable from a loop."""

    def __init__(self, config: Config, *, poll_s: float = 0.05,
                 api: bool | None = None) -> None:
        self.config = config
        self.poll_s = poll_s
        self.api_enabled = config.api.enabled if api is None else api
        self.queue: Queue | None = None
        self.manager: QueueManager | None = None
        self.receiver: Receiver | None = None
        self.pool: ReceiverPool | None = None
        self.api_server: Any = None
        self._lock_fd = -1
        self._manager_stop = asyncio.Event()
        self._manager_task: asyncio.Task[None] | None = None
        self._poller: asyncio.Task[None] | None = None
        self._api_task: asyncio.Task[None] | None = None
        self.addresses: list[tuple[str, int]] = []

    # -- start ---------------------------------------------------------------------

    def _lock(self) -> None:
        path = Path(self.config.queue.path)
        path.mkdir(parents=True, exist_ok=True)
        lock = path / f"manager-{self.config.node.id}.lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ServeError(f"another sluice serve already manages the queue in {path} "
                             f"as node {self.config.node.id!r} (lock {lock})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    async def start(self) -> None:
        cfg = self.config
        self._lock()
        loop = asyncio.get_running_loop()
        self.queue = await loop.run_in_executor(None, Queue.open, cfg)
        hooks = Hooks.from_config(cfg)
        self.manager = QueueManager(cfg, self.queue, router=Router.from_config(cfg),
                                    agent=DeliveryAgent.from_config(cfg), hooks=hooks)
        nproc = receiver_processes(cfg, self.queue.store.shared_access)
        if nproc:
            if cfg.source.startswith("<"):
                self.pool = ReceiverPool(cfg, nproc)
            else:
                self.pool = ReceiverPool(cfg.source, nproc)
            self.addresses = await loop.run_in_executor(None, self.pool.start)
            self._poller = asyncio.ensure_future(self._poll())
        else:
            manager = self.manager
            self.receiver = Receiver.from_config(
                cfg, self.queue, hooks=hooks,
                on_accepted=lambda accepted, sub: manager.notify_mail(len(accepted.qids)))
            await self.receiver.start()
            self.addresses = self.receiver.addresses
        self._manager_task = asyncio.ensure_future(self.manager.run(self._manager_stop))
        if self.api_enabled:
            await self._start_api()

    async def _start_api(self) -> None:
        try:
            from sluice.api.server import start_api
        except ImportError as exc:
            log.error("api.enabled is true but the API cannot be loaded (%s); running without it",
                      exc)
            return
        assert self.manager is not None
        assert self.queue is not None
        self.api_server = await start_api(self.config, self.queue, self.manager)

    async def _poll(self) -> None:
        assert self.manager is not None
        while True:
            await asyncio.sleep(self.poll_s)
            self.manager.notify_mail(0)

    # -- stop -----------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop receiving, finish deliveries, give back claims, close the queue."""
        loop = asyncio.get_running_loop()
        if self.pool is not None:
            await loop.run_in_executor(None, self.pool.stop)
        if self.receiver is not None:
            await self.receiver.stop()
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self.api_server is not None:
            with contextlib.suppress(Exception):
                await self.api_server.stop()
        self._manager_stop.set()
        if self._manager_task is not None:
            await self._manager_task
        if self.queue is not None:
            await loop.run_in_executor(None, self.queue.close)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    async def wait(self) -> None:
        """Until the queue manager ends (normally only after stop())."""
        if self._manager_task is not None:
            await asyncio.shield(self._manager_task)


def serve(config: Config, *, log_level: str | None = None,
          on_ready: Callable[[Server], None] | None = None) -> int:
    """Run until SIGTERM/SIGINT; returns the exit status."""
    setup_logging(config.logging, log_level, hostname=config.hostname)
    try:
        import uvloop

        runner: Callable[..., Any] = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.run

    async def main() -> int:
        server = Server(config)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await server.start()
        except BaseException:
            await server.stop()
            raise
        loop.add_signal_handler(signal.SIGHUP, lambda: server.manager and
                                server.manager.reload_policy())
        where = ", ".join(f"{h}:{p}" for h, p in server.addresses)
        mode = (f"{len(server.pool.pids)} receiving processes" if server.pool
                else "receiving in-process")
        ready(f"sluice serving SMTP on {where} ({mode}), queue {config.queue.path} "
              f"({config.queue.store})")
        if on_ready is not None:
            on_ready(server)
        await stop.wait()
        log.info("stopping: no new mail, finishing deliveries")
        await server.stop()
        log.info("stopped")
        return 0

    result: int = runner(main())
    return result
