"""SIGKILL of `sluice serve` during a 5,000-message injection loses nothing that got 250.

Eight clients inject 5,000 numbered messages.  Mid-way the whole serve
process group (queue manager and receiving processes) is killed with
SIGKILL; it is started again on the same queue and the clients carry on
with the messages they had not had accepted.  At the end every message
answered with 250 has reached the sink.  Duplicates (accepted, delivered,
killed before the delivery was recorded) are allowed: they are counted and
reported.
"""

from __future__ import annotations

import contextlib
import random
import re
import signal
import smtplib
import threading
from collections import Counter
from pathlib import Path

import pytest

from sluice.sink import Sink
from tests.integration.serving import (
    free_port,
    start_serve_with,
    wait_until,
    write_serve_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOTAL = 5000
CLIENTS = 8
ID_RE = re.compile(rb"^X-Test-Id: (\d+)\r?$", re.MULTILINE)


class Injector:
    """Clients that send numbered messages and remember which got 250."""

    def __init__(self, todo: list[int]) -> None:
        self.todo = todo
        self.lock = threading.Lock()
        self.acked: set[int] = set()
        self.failed: list[int] = []

    def take(self) -> int | None:
        with self.lock:
            return self.todo.pop() if self.todo else None

    def run(self, port: int, stop: threading.Event) -> None:
        client: smtplib.SMTP | None = None
        while not stop.is_set():
            n = self.take()
            if n is None:
                break
            msg = (f"Subject: crash test {n}\r\nX-Test-Id: {n}\r\n\r\n"
                   f"message {n}\r\n").encode()
            try:
                if client is None:
                    client = smtplib.SMTP("127.0.0.1", port, local_hostname="inject.test",
                                          timeout=10)
                client.sendmail("inject@sender.example", [f"r{n}@dest.example"], msg)
            except (OSError, smtplib.SMTPException):
                # No 250: the message is not ours to deliver; it is sent again later.
                with self.lock:
                    self.failed.append(n)
                client = None
                continue
            with self.lock:
                self.acked.add(n)
        if client is not None:
            with contextlib.suppress(OSError, smtplib.SMTPException):
                client.quit()

    def inject(self, port: int, stop: threading.Event) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.run, args=(port, stop)) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        return threads


def test_sigkill_during_injection_loses_nothing_accepted(tmp_path: Path) -> None:
    sink = Sink(keep=True)
    sport = sink.start_in_thread()
    port = 0
    try:
        port = free_port()
        config = write_serve_config(tmp_path, port, smtpd={"processes": 2},
                                    delivery={"transport": {"*": f"smtp:[127.0.0.1]:{sport}"}})
        inj = Injector(list(range(TOTAL, 0, -1)))
        srv = start_serve_with(config, tmp_path, port)
        stop = threading.Event()
        threads = inj.inject(port, stop)
        # Kill somewhere in the middle of the injection.
        target = random.Random(5000).randint(TOTAL // 5, TOTAL // 2)
        assert wait_until(lambda: len(inj.acked) >= target, 120)
        srv.stop(signal.SIGKILL)
        acked_at_kill = len(inj.acked)
        stop.set()
        for t in threads:
            t.join(30)
        # Start again on the same queue; send what was not accepted.
        with inj.lock:
            inj.todo.extend(inj.failed)
            inj.failed.clear()
        srv = start_serve_with(config, tmp_path, port)
        try:
            stop = threading.Event()
            for t in inj.inject(port, stop):
                t.join(300)
            assert inj.failed == [], "the restarted server refused mail"
            assert len(inj.acked) == TOTAL

            def delivered() -> Counter[int]:
                return Counter(int(m) for msg in list(sink.messages)
                               for m in ID_RE.findall(msg.data))

            assert wait_until(lambda: set(delivered()) >= inj.acked, 180), (
                f"lost: {sorted(inj.acked - set(delivered()))[:20]}")
            assert wait_until(lambda: srv.recipients_left() == 0, 60)
        finally:
            assert srv.stop() == 0
        counts = delivered()
        lost = inj.acked - set(counts)
        dupes = sum(n - 1 for n in counts.values() if n > 1)
        print(f"\nsigkill test: killed after {acked_at_kill} accepted; {TOTAL} accepted in all; "
              f"{len(counts)} distinct delivered; {dupes} duplicates; {len(lost)} lost")
        assert not lost
        assert dupes < TOTAL // 10  # only those in flight at the kill may come twice
    finally:
        sink.stop_thread()
