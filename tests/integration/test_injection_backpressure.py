"""The sendout's injection client against a loopback HTTP server that pushes back.

A real HTTP server on 127.0.0.1 plays the injection API: it answers 503
with Retry-After, 500, or drops the connection, as scripted; the client
(sluice.pipeline.injection._send_batch over its keep-alive connection)
must wait as told (a fake sleep records the waits), retry, and in the end
give every recipient an outcome -- queued, or refused with a 451 that says
why -- never drop one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from sluice.pipeline import injection
from sluice.pipeline.injection import InjectTarget, _Http

pytestmark = pytest.mark.integration


class Script:
    """What the server answers, one entry per request; the last repeats."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = answers
        self.bodies: list[dict[str, Any]] = []
        self.keys: list[list[str]] = []


def _handler(script: Script) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            script.bodies.append(body)
            rcpts = body["messages"][0]["recipients"]
            script.keys.append([r["idempotency_key"] for r in rcpts])
            n = len(script.bodies) - 1
            answer = script.answers[min(n, len(script.answers) - 1)]
            if answer == "drop":
                self.close_connection = True
                self.connection.close()
                return
            if answer == "busy":
                self._send(503, {"error": "busy", "detail": "queue full"},
                           {"Retry-After": "7"})
            elif answer == "fail":
                self._send(500, {"error": "internal"})
            else:  # ok: queue them all
                self._send(200, {"messages": [{"recipients": [
                    {"status": "queued", "queue_id": f"Q{n}-{i}"} for i in range(len(rcpts))]}]})

        def _send(self, status: int, body: dict[str, Any],
                  headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

    return Handler


@pytest.fixture
def api() -> Iterator[tuple[Script, str]]:
    script = Script(["ok"])
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(script))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield script, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _send_batch(api: _Http, target: InjectTarget, rows: list[dict[str, Any]],
                sleep: Any) -> list[dict[str, Any]]:
    try:
        return injection._send_batch(api, target, rows, sleep=sleep)
    finally:
        api.close()


def _rows(n: int) -> list[dict[str, Any]]:
    return [{"row": i, "input": f"r{i}@d.example", "address": f"r{i}@d.example",
             "domain": "d.example", "substitutions": {}} for i in range(n)]


def _target(url: str, **kw: Any) -> InjectTarget:
    return InjectTarget(url=url, token="t", sender="s@e.example", job="job1", tenant="acme",
                        template={"subject": "hi"}, **kw)


def test_busy_answers_are_waited_out_as_told_and_nothing_is_lost(api) -> None:
    script, url = api
    script.answers[:] = ["busy", "busy", "ok"]
    waits: list[float] = []
    target = _target(url)
    out = _send_batch(_Http(target), target, _rows(5), sleep=waits.append)
    assert waits == [7.0, 7.0]  # Retry-After, as the server said
    assert [o["status"] for o in out] == ["queued"] * 5
    assert {o["queue_id"] for o in out} == {f"Q2-{i}" for i in range(5)}
    # Every retry carried the same idempotency keys: a resend queues nothing twice.
    assert script.keys[0] == script.keys[1] == script.keys[2]


def test_busy_beyond_max_wait_refuses_every_recipient_with_the_reason(api) -> None:
    script, url = api
    script.answers[:] = ["busy"]
    waits: list[float] = []
    target = _target(url, max_wait_s=20.0)
    out = _send_batch(_Http(target), target, _rows(3), sleep=waits.append)
    assert waits == [7.0, 7.0]  # a third wait would pass 20 s
    assert [(o["status"], o["code"], o["enhanced"]) for o in out] == [("refused", 451, "4.3.2")] * 3
    assert all("queue full" in o["reason"] for o in out)


def test_server_errors_back_off_then_refuse_after_the_attempts(api) -> None:
    script, url = api
    script.answers[:] = ["fail"]
    waits: list[float] = []
    target = _target(url, attempts=3)
    out = _send_batch(_Http(target), target, _rows(2), sleep=waits.append)
    assert len(script.bodies) == 3
    assert waits == [waits[0], waits[0] * 2]  # doubling back-off
    assert [(o["status"], o["enhanced"]) for o in out] == [("refused", "4.3.0")] * 2
    assert all("HTTP 500" in o["reason"] for o in out)


def test_a_dropped_connection_is_made_again_and_the_batch_sent_again(api) -> None:
    script, url = api
    script.answers[:] = ["drop", "ok"]
    target = _target(url)
    out = _send_batch(_Http(target), target, _rows(4), sleep=lambda s: None)
    assert len(script.bodies) == 2 and script.keys[0] == script.keys[1]
    assert [o["status"] for o in out] == ["queued"] * 4
