"""SIGKILL of `sluice serve` during an injection loses nothing that got 250, on every store.

For each store flavour (SQLite, filesystem, PostgreSQL, LevelDB), eight
clients inject TOTAL numbered messages while the queue manager delivers them
to a sink.  Twice, at seeded random points of the injection, the whole
serve process group (queue manager and receiving processes) is killed with
SIGKILL; it is started again on the same queue and the clients carry on with
the messages they had not had accepted.  At the end every message answered
with 250 has reached the sink.  Duplicates (accepted, delivered, killed
before the delivery was recorded) are allowed: they are counted and
reported.  (``sqlite_files`` is left out: it is the sqlite store with its
content in spool files, which the fs flavour's files already cover here;
``sqlite_segments`` puts every message in a spool segment.)
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import signal
import smtplib
import threading
import urllib.request
from collections import Counter
from functools import partial
from pathlib import Path

import pytest

from sluice.sink import Sink
from tests.integration.serving import (
    free_port,
    start_serve_with,
    wait_until,
    write_serve_config,
)
from tests.integration.stores import flavour_sections

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CRASH_FLAVOURS = ["sqlite", "sqlite_segments", "fs", "postgres", "kv"]
TOTAL = 1200
KILLS = 2
TOKEN = "0123456789abcdef0123"
CLIENTS = 8
ID_RE = re.compile(rb"^X-Test-Id: (\d+)\r?$", re.MULTILINE)


class Injector:
    """Clients that send numbered messages and remember which got 250."""

    def __init__(self, todo: list[int]) -> None:
        self.todo = todo
        self.lock = threading.Lock()
        self.acked: set[int] = set()
        self.failed: list[int] = []

    def has_acked(self, n: int) -> bool:
        return len(self.acked) >= n

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


def recipients_left(api_port: int) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{api_port}/api/v1/queue/counts",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return int(json.load(response)["recipients"])


@pytest.mark.parametrize("flavour", CRASH_FLAVOURS)
def test_sigkill_during_injection_loses_nothing_accepted(tmp_path: Path, flavour: str) -> None:
    sink = Sink(keep=True)
    sport = sink.start_in_thread()
    try:
        port, api_port = free_port(), free_port()
        # The queue's count comes from the API: LevelDB's lock keeps `sluice
        # qcount` out of a queue that a running server holds.
        config = write_serve_config(tmp_path, port, smtpd={"processes": 2},
                                    delivery={"transport": {"*": f"smtp:[127.0.0.1]:{sport}"}},
                                    api={"enabled": True, "listen": f"127.0.0.1:{api_port}",
                                         "tokens": {"ops": TOKEN}},
                                    **flavour_sections(flavour, tmp_path))
        inj = Injector(list(range(TOTAL, 0, -1)))
        rng = random.Random(f"{TOTAL}:{flavour}")
        # Kill points spread over the injection, each in its own stretch.
        stretch = TOTAL // (KILLS + 1)
        targets = [k * stretch + rng.randint(stretch // 4, stretch * 3 // 4)
                   for k in range(KILLS)]
        acked_at_kill: list[int] = []
        delivered_at_kill: list[int] = []
        srv = start_serve_with(config, tmp_path, port)
        for target in targets:
            stop = threading.Event()
            threads = inj.inject(port, stop)
            assert wait_until(partial(inj.has_acked, target), 120)
            srv.stop(signal.SIGKILL)
            acked_at_kill.append(len(inj.acked))
            delivered_at_kill.append(len(sink.messages))
            stop.set()
            for t in threads:
                t.join(30)
            # Start again on the same queue; what was not accepted is sent again.
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
                f"lost: {sorted(inj.acked - set(delivered()))[:20]}; "
                f"{recipients_left(api_port)} recipients still queued; serve said:\n"
                + "\n".join(srv.output[-40:]))
            assert wait_until(lambda: recipients_left(api_port) == 0, 60)
        finally:
            assert srv.stop() == 0
        counts = delivered()
        lost = inj.acked - set(counts)
        dupes = sum(n - 1 for n in counts.values() if n > 1)
        print(f"\nsigkill test [{flavour}]: {KILLS} kills survived, after {acked_at_kill} "
              f"accepted and {delivered_at_kill} delivered; {TOTAL} accepted in all; "
              f"{len(counts)} distinct delivered; {dupes} duplicates; {len(lost)} lost")
        # Deliveries were in flight: some mail had reached the sink at each kill.
        assert delivered_at_kill[0] > 0
        assert not lost
        assert dupes < TOTAL // 10  # only those in flight at a kill may come twice
    finally:
        sink.stop_thread()
