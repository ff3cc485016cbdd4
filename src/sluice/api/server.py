"""The API server inside `sluice serve`: uvicorn on the serve process's loop.

SUMMARY
    api = await start_api(config, queue, manager)   # listening on return
    ...
    await api.stop()

DESCRIPTION
    start_api binds ``api.listen`` itself (so a taken port is a one-line
    ServeError before anything else runs), builds the application
    (sluice.api.app) and runs uvicorn's server as a task of the running
    loop, beside the queue manager: every request sees the scheduler as
    it is, with no copy and no lock.  Signals stay with `sluice serve`
    (uvicorn's own handlers are not installed) and there is no ASGI
    lifespan: this module starts and stops what the API needs.

    Besides the HTTP server it runs the metrics tail: every second the
    lines appended to the accounting log are counted (sluice.api.metrics)
    and a throughput sample is taken.  It also wraps the queue's store in
    a TimedStore for the store latency histogram, and unwraps it on stop.

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
from pathlib import Path

import uvicorn

from sluice.api.app import build_app
from sluice.api.audit import AuditLog
from sluice.api.auth import Tokens
from sluice.api.control import Control
from sluice.api.metrics import Metrics, TimedStore
from sluice.config import Config
from sluice.queue import Queue
from sluice.runtime.manager import QueueManager
from sluice.runtime.serve import ServeError
from sluice.shaping.metrics import ShapingCollector

__all__ = ["ApiServer", "parse_listen", "start_api"]

log = logging.getLogger("sluice.api")

#: How often the accounting log is read for the metrics.
TAIL_INTERVAL_S = 1.0


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
    """The running API: its address, and stop()."""

    def __init__(self, config: Config, queue: Queue, manager: QueueManager) -> None:
        self.config = config
        self.queue = queue
        self.manager = manager
        self.metrics = Metrics(config)
        audit_path = config.api.audit_path or str(Path(config.queue.path) / "api-audit.jsonl")
        self.audit = AuditLog(audit_path)
        manager.shaper.audit = self.audit  # shaping: automatic actions are audited too
        self.metrics.registry.register(ShapingCollector(manager.shaper))  # shaping
        self.control = Control(config, queue, manager, self.audit, self.metrics)
        self.tokens = Tokens(config.api.named_tokens)
        self.app = build_app(self.control, self.tokens)
        self.address: tuple[str, int] = ("", 0)
        self._sock: socket.socket | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._tail: asyncio.Task[None] | None = None
        self._inner_store = queue.store

    def _bind(self) -> socket.socket:
        try:
            host, port = parse_listen(self.config.api.listen)
        except ValueError as exc:
            raise ServeError(f"api.listen: {exc}") from None
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise ServeError(f"api.listen {self.config.api.listen}: {exc.strerror}") from None
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
            raise ServeError(f"api.listen {self.config.api.listen}: cannot listen: "
                             f"{exc.strerror or exc}") from None
        sock.setblocking(False)
        return sock

    async def start(self) -> None:
        self._sock = self._bind()
        bound = self._sock.getsockname()
        self.address = (str(bound[0]), int(bound[1]))
        if not len(self.tokens):
            log.warning("api.tokens is empty: every API request but /api/v1/health is "
                        "refused (401)")
        self.metrics.tail.prime()
        self.queue.store = TimedStore(self._inner_store, self.metrics)
        cfg = uvicorn.Config(self.app, lifespan="off", log_config=None, access_log=False,
                             log_level="warning", server_header=False,
                             timeout_graceful_shutdown=2, limit_concurrency=200,
                             proxy_headers=False)
        self._server = _Server(cfg)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
        self._tail = asyncio.ensure_future(self._follow())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise ServeError("the API server stopped while starting")
            await asyncio.sleep(0.01)
        host, port = self.address
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.info("API and web page on http://%s/ (%d tokens)", shown, len(self.tokens))
        print(f"sluice: API and web page on http://{shown}/", flush=True)

    async def _follow(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await loop.run_in_executor(self.control.pool, self.metrics.poll, time.time())
            except Exception:
                log.exception("reading the accounting log for metrics failed")
            await asyncio.sleep(TAIL_INTERVAL_S)

    async def stop(self) -> None:
        if self._tail is not None:
            self._tail.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tail
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        if self._sock is not None:
            self._sock.close()
        if self.queue.store is not self._inner_store:
            self.queue.store = self._inner_store
        await asyncio.get_running_loop().run_in_executor(None, self.control.close)


async def start_api(config: Config, queue: Queue, manager: QueueManager) -> ApiServer:
    """Start the API of a running `sluice serve`; listening when it returns."""
    server = ApiServer(config, queue, manager)
    try:
        await server.start()
    except BaseException:
        await server.stop()
        raise
    return server
