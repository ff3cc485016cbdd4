"""The delivery agent against Postfix's smtp-sink: a pipelining C server, SMTP and LMTP."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sluice._loopback import free_port
from sluice.config import config_from_dict
from sluice.delivery import DeliveryAgent, DeliveryRequest, Host, NextHop
from sluice.model import Delivered, QueueEntry, QueueState, TempFail
from sluice.scheduler.events import Transport
from tests.integration.test_delivery_peers import run

SMTP_SINK = shutil.which("smtp-sink") or ("/usr/sbin/smtp-sink"
                                          if os.path.exists("/usr/sbin/smtp-sink") else None)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(SMTP_SINK is None, reason="Postfix's smtp-sink is not installed"),
]


@contextmanager
def smtp_sink(*options: str, dump: Path | None = None) -> Iterator[int]:
    """smtp-sink on 127.0.0.1 with ``options``; yields the port."""
    assert SMTP_SINK is not None
    port = free_port()
    args = [SMTP_SINK, "-h", "sink.test", *options]
    if os.geteuid() == 0:
        args += ["-u", "nobody"]  # smtp-sink refuses to run as root
    if dump is not None:
        # smtp-sink writes as "nobody": pytest's 0700 tmp_path is out of its reach.
        dump.mkdir(mode=0o777)
        dump.chmod(0o777)
        args += ["-d", f"{dump}/%H%M%S."]
    proc = subprocess.Popen([*args, f"127.0.0.1:{port}", "100"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 5
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    raise RuntimeError(f"smtp-sink did not start: {err}") from None
                time.sleep(0.02)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=5)
        if proc.stderr is not None:
            proc.stderr.close()


def agent() -> DeliveryAgent:
    cfg = config_from_dict({"node": {"hostname": "client.test"},
                            "delivery": {"starttls": "none", "max_messages_per_connection": 50}})
    return DeliveryAgent.from_config(cfg)


def entries(spid: int, *rcpts: str, size: int = 0) -> tuple[QueueEntry, ...]:
    return tuple(QueueEntry(spid=f"{spid:016X}", idx=i, sender="s@src.test", recipient=r,
                            state=QueueState.DELIVERING, arrival_at=0.0, next_attempt_at=0.0,
                            size=size)
                 for i, r in enumerate(rcpts))


def body(i: int) -> bytes:
    return (b"Subject: message %d\r\n\r\n.leading dot %d\r\n" % (i, i)
            + b"x" * 900 + b"\r\n..two dots\r\n")


@pytest.fixture
def dump() -> Iterator[Path]:
    top = Path(tempfile.mkdtemp(prefix="sluice-sink-"))
    top.chmod(0o755)
    try:
        yield top / "dump"
    finally:
        shutil.rmtree(top)


def test_many_messages_over_few_pipelined_connections(dump: Path) -> None:
    count, workers = 200, 10

    async def scenario(port: int) -> list[bool]:
        a = agent()
        route = NextHop(Transport.SMTP, (Host("sink.test", "127.0.0.1", port),), "sink")
        news: list[bool] = []

        async def worker(k: int) -> None:
            for i in range(k, count, workers):
                data = body(i)
                res = await a.deliver(DeliveryRequest(
                    route, entries(i, f"r{i}@dest.test", size=len(data)),
                    lambda data=data: io.BytesIO(data)))
                assert [type(o) for _, o in res.outcomes] == [Delivered], res
                news.append(res.new_connection)

        await asyncio.gather(*(worker(k) for k in range(workers)))
        await a.close()
        return news

    with smtp_sink(dump=dump) as port:
        news = run(scenario(port))
        deadline = time.monotonic() + 5
        while len(list(dump.iterdir())) < count and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(news) == count and sum(news) <= 2 * workers  # reuse, not one per message
    dumps = sorted(dump.iterdir())
    assert len(dumps) == count
    # smtp-sink writes LF line ends and adds its own headers in front.
    texts = {p.read_bytes().split(b"Subject: ", 1)[1].rstrip(b"\n") for p in dumps}
    want = {body(i).split(b"Subject: ", 1)[1].replace(b"\r\n", b"\n").rstrip(b"\n")
            for i in range(count)}
    assert texts == want


def test_lmtp_mode_answers_each_recipient() -> None:
    async def scenario(port: int) -> list[int]:
        route = NextHop(Transport.LMTP, (Host("sink.test", "127.0.0.1", port),), "lmtp")
        a = agent()
        res = await a.deliver(DeliveryRequest(
            route, entries(1, "a@d.test", "b@d.test", "c@d.test"),
            lambda: io.BytesIO(body(1))))
        await a.close()
        return [o.reply.code for _, o in res.outcomes if isinstance(o, Delivered)]

    with smtp_sink("-L") as port:
        assert run(scenario(port)) == [250, 250, 250]


def test_soft_rejected_recipients_are_deferred() -> None:
    async def scenario(port: int) -> list[tuple[type, int, str]]:
        route = NextHop(Transport.SMTP, (Host("sink.test", "127.0.0.1", port),), "soft")
        a = agent()
        res = await a.deliver(DeliveryRequest(
            route, entries(2, "a@d.test", "b@d.test"), lambda: io.BytesIO(body(2))))
        await a.close()
        return [(type(o), o.reply.code, o.reply.enhanced) for _, o in res.outcomes]

    with smtp_sink("-r", "RCPT") as port:
        assert run(scenario(port)) == [(TempFail, 450, "4.3.0")] * 2
