"""The API server inside `sluice serve`: uvicorn on the serve process's loop.

SUMMARY
    api = ApiServer(config, queue, manager, audit)
    api.bind()                          # ApiStartError: one line, before anything runs
    parts: api.serve(trouble), api.follow(trouble)   (the runtime runs and restarts them)
    await api.listening(); ...; await api.stop()

DESCRIPTION
    The runtime owns this server: sluice.runtime.serve creates it with its
    queue and queue manager, and runs its two parts under its own
    supervision (sluice.runtime.parts) -- the HTTP server, and the
    metrics follower, which every second counts the lines appended to the
    accounting log (sluice.api.metrics) and takes a throughput sample.
    Either is started again after a back-off if it fails.  The queue
    manager is used through the narrow protocol of sluice.api.ports: this
    package never imports sluice.runtime.

    bind() binds ``api.listen`` itself (so a taken port is a one-line
    error before anything else runs); uvicorn serves on that socket, on
    the running loop beside the queue manager: every request sees the
    scheduler as it is, with no copy and no lock.  Signals stay with
    `sluice serve` (uvicorn's own handlers are not installed) and there
    is no ASGI lifespan.  The queue's store is wrapped in a TimedStore for
    the store latency histogram while the server runs.

SEE ALSO
    sluice.api.app, sluice.api.control, sluice.runtime.serve, docs/api.md
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from typing import Protocol

import uvicorn

from sluice.api.app import build_app
from sluice.api.audit import AuditLog
from sluice.api.auth import Tokens
from sluice.api.control import Control
from sluice.api.metrics import Metrics
from sluice.api.ports import Manager
from sluice.api.timed_store import TimedStore
from sluice.config import Config
from sluice.queue import Queue
from sluice.shaping.metrics import ShapingCollector
from sluice.store import StorageError

__all__ = ["ApiServer", "ApiStartError", "parse_listen"]

log = logging.getLogger("sluice.api")

#: How often the accounting log is read for the metrics.
TAIL_INTERVAL_S = 1.0


class ApiStartError(Exception):
    """The API cannot start (the message says why, in one line)."""


class Health(Protocol):
    """What a part tells its supervisor (sluice.runtime.parts.Trouble)."""

    def ok(self) -> None: ...


def parse_listen(text: str) -> tuple[str, int]:
    """'127.0.0.1:8025', '[::1]:8025', 'localhost:8025' -> (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not host:port")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: `sluice serve` owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ApiServer:
    """The API of a running `sluice serve`: its address, its parts, stop()."""

    def __init__(self, config: Config, queue: Queue, manager: Manager,
                 audit: AuditLog) -> None:
        self.config = config
        self.queue = queue
        self.metrics = Metrics(config)
        self.audit = audit
        manager.shaper.audit = audit  # shaping: automatic actions are audited too
        self.metrics.registry.register(ShapingCollector(manager.shaper))  # shaping
        self.control = Control(config, queue, manager, audit, self.metrics)
        self.tokens = Tokens(config.api.named_tokens)
        self.app = build_app(self.control, self.tokens)
        self.address: tuple[str, int] = ("", 0)
        self._sock: socket.socket | None = None
        self._server: _Server | None = None
        self._stopping = False
        self._inner_store = queue.store

    def bind(self) -> None:
        """Listen on api.listen (ApiStartError in one line if it cannot)."""
        try:
            host, port = parse_listen(self.config.api.listen)
        except ValueError as exc:
            raise ApiStartError(f"api.listen: {exc}") from None
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise ApiStartError(f"api.listen {self.config.api.listen}: {exc.strerror}"
                                ) from None
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise ApiStartError(f"api.listen {self.config.api.listen}: cannot listen: "
                                f"{exc.strerror or exc}") from None
        sock.setblocking(False)
        self._sock = sock
        bound = sock.getsockname()
        self.address = (str(bound[0]), int(bound[1]))
        if not len(self.tokens):
            log.warning("api.tokens is empty: every API request but /api/v1/health is "
                        "refused (401)")
        self.metrics.tail.prime()
        self.queue.store = TimedStore(self._inner_store, self.metrics)

    # -- the parts the runtime runs -------------------------------------------------------

    async def serve(self, trouble: Health) -> None:
        """The HTTP server, until stop() (a part: started again if it fails)."""
        assert self._sock is not None, "bind() first"
        if self._stopping:
            return
        cfg = uvicorn.Config(self.app, lifespan="off", log_config=None, access_log=False,
                             log_level="warning", server_header=False,
                             timeout_graceful_shutdown=2, limit_concurrency=200,
                             proxy_headers=False)
        server = self._server = _Server(cfg)
        # uvicorn closes the sockets it served on: it gets a duplicate, so that
        # a restart finds the listening socket still open.
        sock = self._sock.dup()
        try:
            async with asyncio.TaskGroup() as group:
                started = group.create_task(self._started(server, trouble))
                try:
                    await server.serve(sockets=[sock])
                finally:
                    started.cancel()
        finally:
            # Cancelled (the process stops after a failure): uvicorn did not
            # shut down, so close what it listened on here.
            for listener in getattr(server, "servers", []):
                listener.close()
            sock.close()
        if not self._stopping:
            raise RuntimeError("the HTTP server stopped by itself")

    @staticmethod
    async def _started(server: _Server, trouble: Health) -> None:
        while not server.started:  # noqa: ASYNC110 - uvicorn sets a flag, no event
            await asyncio.sleep(0.01)
        trouble.ok()

    async def follow(self, trouble: Health) -> None:
        """The metrics follower: the accounting log, every second (a part)."""
        loop = asyncio.get_running_loop()
        while True:
            now = time.time()
            await loop.run_in_executor(self.control.pool, self.metrics.poll, now)
            if self.metrics.activity.queue_due(now):
                await self._sample_queue(now)
            trouble.ok()
            await asyncio.sleep(TAIL_INTERVAL_S)

    async def _sample_queue(self, now: float) -> None:
        """The queue's size for the web page's chart (every 10 s).

        SQLite and the KV store keep these counts; PostgreSQL and the file store
        count (as a /metrics scrape does).  A store that fails is logged here
        and reported by the parts that need it.
        """
        try:
            counts = await asyncio.get_running_loop().run_in_executor(
                self.control.pool, self.queue.store.count)
        except StorageError as exc:
            log.warning("queue size for the chart not read: %s", exc)
            return
        self.metrics.activity.sample_queue(
            now, counts.recipients, {str(k): v for k, v in counts.by_state.items()})

    async def listening(self, timeout_s: float = 10.0) -> None:
        """Until uvicorn has started (ApiStartError if it does not)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._server is None or not self._server.started:
            if loop.time() > deadline:
                raise ApiStartError(f"the API server on {self.config.api.listen} did not "
                                    f"start within {timeout_s:g}s")
            await asyncio.sleep(0.01)
        host, port = self.address
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.info("API and web page on http://%s/ (%d tokens)", shown, len(self.tokens))
        print(f"sluice: API and web page on http://{shown}/", flush=True)

    # -- stop ---------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask the HTTP server to finish (serve() then returns)."""
        self._stopping = True
        if self._server is not None:
            self._server.should_exit = True

    async def stop(self) -> None:
        """After the parts ended: close the socket, unwrap the store, close the pool."""
        self.request_stop()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.queue.store is not self._inner_store:
            self.queue.store = self._inner_store
        await asyncio.get_running_loop().run_in_executor(None, self.control.close)
