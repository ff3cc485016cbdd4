"""`sluice serve`: receive, queue and deliver in one command.

SUMMARY
    serve(config) -> exit status
    await Server(config).run(stop_event)          (or start() ... stop())

DESCRIPTION
    One queue manager (this process) and the receivers:

    * with a store that several processes may open (SQLite, PostgreSQL),
      ``smtpd.processes`` receiving processes (default: one per core but
      one) accept from the listening sockets this process bound and
      handed to them; the queue manager learns of
      new mail by polling the store every ``poll_s`` (a read that costs
      microseconds when nothing is new);
    * otherwise (LevelDB) the receiver runs inside this process and tells
      the queue manager of each message directly.

    Starting checks the configuration first (sluice.runtime.preflight,
    the very checks of `sluice config check`), then takes the lock, then
    binds the SMTP port -- without SO_REUSEPORT, so a second `sluice
    serve` on the same port gets "address already in use" as a second
    Postfix would -- and only then opens the queue and starts the parts.

    The queue manager holds an exclusive lock on ``<queue.path>/manager-
    <node id>.lock``, so two managers never work one queue as the same
    node.  The runtime owns the API server (sluice.api.server), which
    sees the queue manager through a narrow protocol only.

    Signals: SIGTERM or SIGINT stop gracefully -- receivers stop accepting
    and finish the messages in DATA, in-flight deliveries finish, claims
    are given back -- and the process exits 0.  SIGHUP reloads the pickup
    policy file.  A restart resumes the queue where it was.  Reloads by
    SIGHUP and by the file watcher, and the run-time conditions a restart
    ends, are written to the audit history (sluice.api.audit).

TASKS
    run() owns every long-lived task in one Supervisor
    (sluice.runtime.parts): the queue manager, which cannot restart (its
    failure stops `sluice serve` with one line and exit status 1 -- a
    service manager starts it again, and recovery returns what was in
    flight); and the parts that restart after a back-off when they fail:
    the new-mail poller, the API's HTTP server and its metrics follower.
    Stopping goes in order: receivers (finishing their messages), the
    poller, the API, the queue manager (finishing deliveries), the queue,
    the lock.

SEE ALSO
    sluice.runtime.manager, sluice.runtime.parts, sluice.smtpd, docs/serve.md
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sluice import _native
from sluice.api.audit import AuditAction, AuditLog, audit_path
from sluice.config import Config
from sluice.delivery.agent import DeliveryAgent
from sluice.delivery.router import Router
from sluice.hooks import Hooks
from sluice.logs import ready, setup_logging
from sluice.queue import Queue
from sluice.runtime.manager import QueueManager
from sluice.runtime.parts import Health, PartFailed, Supervisor, Trouble
from sluice.runtime.preflight import preflight
from sluice.scheduler import Policy
from sluice.smtpd import (
    Receiver,
    ReceiverPool,
    bind_listeners,
    listen_addresses,
    receiver_processes,
)
from sluice.smtpd.dedupe import settle as settle_resends

__all__ = ["PartFailed", "ServeError", "Server", "serve"]

log = logging.getLogger("sluice.serve")


class ServeError(Exception):
    """Sluice cannot start (the message says why, in one line)."""


class Server:
    """Everything `sluice serve` runs: run(stop) owns it from start to stop."""

    def __init__(self, config: Config, *, poll_s: float = 0.05, api: bool | None = None,
                 health: Health | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 manager_options: dict[str, Any] | None = None) -> None:
        self.config = config
        self.poll_s = poll_s
        self.api_enabled = config.api.enabled if api is None else api
        self.health = health or Health()
        self._sleep = sleep
        self._manager_options = dict(manager_options or {})
        self.queue: Queue | None = None
        self.manager: QueueManager | None = None
        self.receiver: Receiver | None = None
        self.pool: ReceiverPool | None = None
        self.api_server: Any = None
        self.audit: AuditLog | None = None
        self.addresses: list[tuple[str, int]] = []
        self._lock_fd = -1
        self._sockets: list[socket.socket] = []  # bound, not yet handed to a receiver
        self._manager_stop = asyncio.Event()
        self._stop = asyncio.Event()
        self._ready = asyncio.Event()
        #: True from the moment every part runs until the stop begins.
        self.serving = False
        self._runner: asyncio.Task[None] | None = None

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

    async def _open(self) -> None:
        """Everything that can refuse to start, before any part runs."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, preflight, cfg)
        self._lock()
        self._sockets = bind_listeners(listen_addresses(cfg), cfg.smtpd.backlog)
        self.queue = await loop.run_in_executor(None, Queue.open, cfg)
        path = audit_path(cfg)
        try:
            self.audit = await loop.run_in_executor(None, AuditLog, path)
        except OSError as exc:
            raise ServeError(f"api.audit_path {path}: {exc.strerror or exc}") from None
        hooks = Hooks.from_config(cfg)
        self.manager = manager = QueueManager(
            cfg, self.queue, router=Router.from_config(cfg),
            agent=DeliveryAgent.from_config(cfg), hooks=hooks, health=self.health,
            sleep=self._sleep, **self._manager_options)
        manager.policy_file.on_reload = self._audit_reload
        with contextlib.suppress(OSError):  # reported by _audit's own logging
            await loop.run_in_executor(None, self._audit_restart)
        if cfg.smtpd.dedupe:
            # Before any receiver serves: claims a crash left pending (sluice.smtpd.dedupe).
            confirmed, forgotten = await loop.run_in_executor(
                None, settle_resends, cfg, self.queue.store)
            if confirmed or forgotten:
                log.info("smtpd.dedupe: messages pending at the last stop: %d queued, %d not",
                         confirmed, forgotten)
        if self.api_enabled:
            self._create_api()
        nproc = receiver_processes(cfg, self.queue.store.shared_access)
        sockets, self._sockets = self._sockets, []  # the receivers own them now
        if nproc:
            # A bad smtpd.auth entry was found by preflight (receiver_parts).
            self.pool = ReceiverPool(cfg if cfg.source.startswith("<") else cfg.source, nproc,
                                     sockets=sockets)
            self.addresses = await loop.run_in_executor(None, self.pool.start)
        else:
            try:
                self.receiver = Receiver.from_config(
                    cfg, self.queue, hooks=hooks, sockets=sockets,
                    on_accepted=lambda accepted, sub: manager.notify_mail(len(accepted.qids)))
            except BaseException:
                for sock in sockets:
                    sock.close()
                raise
            await self.receiver.start()
            self.addresses = self.receiver.addresses

    def _create_api(self) -> None:
        try:
            from sluice.api.server import ApiServer, ApiStartError
        except ImportError as exc:
            log.error("api.enabled is true but the API cannot be loaded (%s); running without it",
                      exc)
            return
        assert self.queue is not None
        assert self.manager is not None
        assert self.audit is not None
        api = ApiServer(self.config, self.queue, self.manager, self.audit)
        try:
            api.bind()
        except ApiStartError as exc:
            raise ServeError(str(exc)) from None
        self.api_server = api

    # -- the audit history of what serve does by itself ----------------------------------

    def _audit_restart(self) -> None:
        assert self.audit is not None
        try:
            record = self.audit.restarted(time.time())
        except OSError as exc:
            log.error("audit history %s not written: %s", self.audit.path, exc)
            raise
        if record is not None:
            log.warning("the restart ended %d condition changes made at run time "
                        "(audit record %d)", len(record.ends), record.id)

    def _audit_reload(self, who: str, reason: str, before: Policy, after: Policy) -> None:
        """A reload by SIGHUP or the file watcher, recorded like the API's."""
        if self.audit is None:
            return
        path = self.config.scheduler.policy or "<no file>"
        try:
            self.audit.append(who, AuditAction.POLICY_RELOAD, path, reason,
                              {"source": before.source, "policy": before.to_data()},
                              {"source": after.source, "policy": after.to_data()},
                              reversible=True, now=time.time())
        except OSError as exc:
            log.error("audit history %s not written: %s", self.audit.path, exc)

    # -- run -----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Start, serve until ``stop`` is set, then stop in order.

        Raises ServeError (it cannot start) or PartFailed (a part that cannot
        restart failed; everything else was stopped first).
        """
        stop = stop or self._stop
        try:
            await self._open()
            async with Supervisor(self.health, sleep=self._sleep) as parts:
                manager = parts.vital("queue manager", self._run_manager)
                poller = parts.keep("new-mail poller", self._poll) if self.pool else None
                api = self.api_server
                if api is not None:
                    http = parts.keep("API server", api.serve)
                    follower = parts.keep("API metrics follower", api.follow)
                    await api.listening()
                self.serving = True
                self._ready.set()
                await stop.wait()
                self.serving = False
                log.info("stopping: no new mail, finishing deliveries")
                await self._stop_receivers()
                if poller is not None:
                    await parts.cancel(poller)
                if api is not None:
                    api.request_stop()
                    await asyncio.wait({http})
                    await parts.cancel(follower)
                self._manager_stop.set()
                await asyncio.wait({manager})
        except BaseExceptionGroup as group:
            failed = _find(group, PartFailed)
            if failed is None:
                raise
            raise failed from None
        finally:
            self.serving = False
            self._ready.set()
            await self._close()

    async def _run_manager(self) -> None:
        assert self.manager is not None
        await self.manager.run(self._manager_stop)

    async def _poll(self, trouble: Trouble) -> None:
        assert self.manager is not None
        while True:
            await asyncio.sleep(self.poll_s)
            self.manager.notify_mail(0)
            trouble.ok()

    # -- stop -----------------------------------------------------------------------

    async def _stop_receivers(self) -> None:
        loop = asyncio.get_running_loop()
        if self.pool is not None:
            pool, self.pool = self.pool, None
            await loop.run_in_executor(None, pool.stop)
        if self.receiver is not None:
            receiver, self.receiver = self.receiver, None
            await receiver.stop()

    async def _close(self) -> None:
        """What is left after the parts ended (or after a failure): in order."""
        await self._stop_receivers()
        for sock in self._sockets:
            sock.close()
        self._sockets = []
        if self.api_server is not None:
            with contextlib.suppress(Exception):
                await self.api_server.stop()
        if self.queue is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.queue.close)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # -- start() and stop(), for a caller that is not run() --------------------------------

    async def start(self) -> None:
        """run() in a task this server owns; returns once serving (or raises)."""
        self._runner = asyncio.create_task(self.run(self._stop), name="sluice serve")
        ready = asyncio.ensure_future(self._ready.wait())
        try:
            await asyncio.wait({self._runner, ready}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if self._runner.done():
            self._runner.result()  # raises why it stopped

    async def stop(self) -> None:
        """Stop gracefully and wait (re-raises PartFailed if a part failed)."""
        self._stop.set()
        if self._runner is not None:
            await self._runner

    async def wait(self) -> None:
        """Until run() ends (normally only after stop())."""
        if self._runner is not None:
            await asyncio.shield(self._runner)


def _find(group: BaseExceptionGroup[Any], kind: type[PartFailed]) -> PartFailed | None:
    for exc in group.exceptions:
        if isinstance(exc, kind):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _find(exc, kind)
            if found is not None:
                return found
    return None


def serve(config: Config, *, log_level: str | None = None,
          on_ready: Callable[[Server], None] | None = None) -> int:
    """Run until SIGTERM/SIGINT; returns the exit status.

    Raises ServeError when it cannot start, PartFailed when a part that
    cannot restart failed.
    """
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
        loop.add_signal_handler(signal.SIGHUP, lambda: server.manager and
                                server.manager.reload_policy(who="SIGHUP",
                                                             reason="reload asked by SIGHUP"))

        async def announce_ready() -> None:
            await server._ready.wait()
            if not server.serving:
                return
            where = ", ".join(f"{h}:{p}" for h, p in server.addresses)
            mode = (f"{len(server.pool.pids)} receiving processes" if server.pool
                    else "receiving in-process")
            ready(f"sluice serving SMTP on {where} ({mode}), queue {config.queue.path} "
                  f"({config.queue.store}), {_native.state()}")
            if on_ready is not None:
                on_ready(server)

        announce = asyncio.create_task(announce_ready())
        try:
            await server.run(stop)
        finally:
            announce.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await announce
        log.info("stopped")
        return 0

    result: int = runner(main())
    return result
