"""Helpers for the API, metrics and web-page tests (no tests of its own).

A real `sluice serve` subprocess with the API on a free loopback port, a
programmable SMTP sink as its next hop, and an HTTP client that speaks to
it with or without a token.  Held entries are queued straight into the
server's SQLite queue from the test process (another process may open
it), so a test gets exactly the queue it describes without waiting for
deliveries.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sluice.config import Config, load_config
from sluice.model import Accepted, Submission
from sluice.queue import Queue
from sluice.sink import Sink
from tests.integration.serving import Serving, free_port, start_serve_with, write_serve_config

TOKENS = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-0123456789abcdef"}
ALICE = TOKENS["alice"]
BOB = TOKENS["bob"]

_counter = itertools.count(1)


@dataclass
class ApiServer:
    """A running `sluice serve` with its API, its sink and a client."""

    serving: Serving
    sink: Sink
    sink_port: int
    config: Config
    url: str
    http: httpx.Client = field(repr=False)
    queue: Queue | None = None

    def call(self, method: str, path: str, *, token: str | None = ALICE,
             json: Any = None, params: Any = None, content: bytes | None = None,
             headers: dict[str, str] | None = None) -> httpx.Response:
        hdrs = dict(headers or {})
        if token is not None:
            hdrs["Authorization"] = f"Bearer {token}"
        return self.http.request(method, path, json=json, params=params, content=content,
                                 headers=hdrs)

    def ok(self, method: str, path: str, **kw: Any) -> Any:
        """Call and expect 2xx; returns the JSON body."""
        resp = self.call(method, path, **kw)
        assert resp.is_success, f"{method} {path}: {resp.status_code} {resp.text}"
        return resp.json()

    def open_queue(self) -> Queue:
        if self.queue is None:
            self.queue = Queue.open(self.config)
        return self.queue

    def hold(self, sender: str, recipients: list[str], *, tenantid: str = "",
             jobid: str = "", body: bytes = b"Subject: held\r\n\r\nbody\r\n") -> Accepted:
        """Queue a message on hold, straight into the server's store."""
        sub = Submission(sender=sender, recipients=tuple(recipients), tenantid=tenantid,
                         jobid=jobid, hold=True)
        return self.open_queue().submit(sub, body)

    def submit(self, sender: str, recipients: list[str], **kw: Any) -> Accepted:
        """Queue a message for delivery (the running manager picks it up)."""
        sub = Submission(sender=sender, recipients=tuple(recipients), **kw)
        return self.open_queue().submit(sub, b"Subject: go\r\n\r\nbody\r\n")

    def counts(self, **params: Any) -> dict[str, Any]:
        result: dict[str, Any] = self.ok("GET", "/api/v1/queue/counts", params=params)
        return result

    def close(self, keep_sink: bool = False) -> int:
        self.http.close()
        if self.queue is not None:
            self.queue.close()
            self.queue = None
        code = self.serving.stop()
        if not keep_sink:
            self.sink.stop_thread()
        return code


def unique(prefix: str) -> str:
    """A domain no other test of the module uses."""
    return f"{prefix}{next(_counter)}.example"


def api_config(tmp: Path, *, sink_port: int, api_port: int | None = None,
               **sections: dict[str, Any]) -> tuple[Path, int]:
    smtp_port = free_port()
    api = {"enabled": True, "listen": f"127.0.0.1:{api_port or free_port()}",
           "tokens": TOKENS, **sections.pop("api", {})}
    delivery = {"transport": {"*": f"smtp:[127.0.0.1]:{sink_port}"},
                **sections.pop("delivery", {})}
    path = write_serve_config(tmp, smtp_port, api=api, delivery=delivery, **sections)
    return path, smtp_port


def start_api_server(tmp: Path, *, reuse: ApiServer | None = None,
                     **sections: dict[str, Any]) -> ApiServer:
    """Start a sink and `sluice serve` with the API enabled; with ``reuse`` (a
    stopped server), the same sink, configuration and queue again."""
    if reuse is not None:
        sink, sink_port = reuse.sink, reuse.sink_port
        config_path, smtp_port = reuse.serving.config, reuse.serving.port
    else:
        sink = Sink(keep=True)
        sink_port = sink.start_in_thread()
        config_path, smtp_port = api_config(tmp, sink_port=sink_port, **sections)
    serving = start_serve_with(config_path, tmp, smtp_port)
    config = load_config(config_path)
    host, _, port = config.api.listen.rpartition(":")
    url = f"http://{host}:{port}"
    return ApiServer(serving, sink, sink_port, config, url,
                     httpx.Client(base_url=url, timeout=30.0))


@contextlib.contextmanager
def api_server(tmp: Path, **sections: dict[str, Any]) -> Iterator[ApiServer]:
    srv = start_api_server(tmp, **sections)
    try:
        yield srv
    finally:
        code = srv.close()
        assert code == 0, f"sluice serve exited with {code}:\n" + "\n".join(srv.serving.output)
