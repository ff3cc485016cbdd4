"""The programmable sink answers as configured and counts what it saw."""

from __future__ import annotations

import smtplib
import threading
import time
from collections.abc import Iterator

import pytest

from sluice.sink import Behaviour, Sink

pytestmark = pytest.mark.integration


@pytest.fixture
def sink() -> Iterator[tuple[Sink, int]]:
    s = Sink({"grey.example": Behaviour("greylist"), "bad.example": Behaviour("reject"),
              "down.example": Behaviour("tempfail"), "*.slowish.example": Behaviour("slow", 0.3),
              "busy.example": Behaviour("throttle", per_minute=2)}, keep=True)
    port = s.start_in_thread()
    yield s, port
    s.stop_thread()


def send(port: int, rcpts: list[str], sender: str = "a@example.org"
         ) -> dict[str, tuple[int, bytes]]:
    with smtplib.SMTP("127.0.0.1", port, local_hostname="client.test") as c:
        try:
            return c.sendmail(sender, rcpts, b"Subject: t\r\n\r\nbody\r\n")
        except smtplib.SMTPRecipientsRefused as exc:
            return exc.recipients


def test_behaviours_per_domain(sink: tuple[Sink, int]) -> None:
    s, port = sink
    refused = send(port, ["u@ok.example", "u@grey.example", "u@bad.example", "u@down.example"])
    assert {k: v[0] for k, v in refused.items()} == {
        "u@grey.example": 451, "u@bad.example": 550, "u@down.example": 451}
    assert send(port, ["u@grey.example"]) == {}  # greylisting lets the retry through
    refused = send(port, ["u@busy.example"] * 3)
    assert [v[0] for v in refused.values()] == [451]  # the third in a minute is throttled
    snap = s.snapshot()
    assert snap.delivered == {"ok.example": 1, "grey.example": 1, "busy.example": 2}
    assert snap.replies[("bad.example", 550)] == 1
    assert s.messages[0].recipients == ("u@ok.example",)
    assert s.messages[0].data == b"Subject: t\r\n\r\nbody\r\n"


def test_concurrency_is_tracked_per_domain(sink: tuple[Sink, int]) -> None:
    s, port = sink
    threads = [threading.Thread(target=send, args=(port, ["u@a.slowish.example"]))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.monotonic() + 5  # the server sees the close a moment after QUIT
    while s.snapshot().current_connections and time.monotonic() < deadline:
        time.sleep(0.01)
    snap = s.snapshot()
    assert snap.peak_by_domain["a.slowish.example"] == 4
    assert snap.peak_connections >= 4
    assert snap.current_connections == 0
    assert snap.current_by_domain["a.slowish.example"] == 0
    assert snap.delivered["a.slowish.example"] == 4


def test_a_connection_stops_counting_at_quit_and_only_once(sink: tuple[Sink, int]) -> None:
    s, port = sink
    c = smtplib.SMTP("127.0.0.1", port, local_hostname="client.test")
    c.sendmail("a@example.org", ["u@ok.example"], b"Subject: t\r\n\r\nbody\r\n")
    assert s.snapshot().current_by_domain["ok.example"] == 1
    code, _ = c.docmd("QUIT")  # said, and the 221 read: the socket is still open here
    assert code == 221
    snap = s.snapshot()
    assert snap.current_by_domain["ok.example"] == 0 and snap.current_connections == 0
    c.close()
    send(port, ["u@ok.example"])  # one more, from connect to close
    deadline = time.monotonic() + 5  # the server sees each close a moment later
    while s.snapshot().current_connections > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # and a close counted twice would show by now
    snap = s.snapshot()
    assert snap.connections == 2
    assert snap.current_connections == 0 and snap.current_by_domain["ok.example"] == 0
    assert snap.peak_by_domain["ok.example"] == 1
