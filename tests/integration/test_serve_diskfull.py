"""A full disk under a running `sluice serve`: 451, not 250, and what was accepted still goes out.

`sluice serve` runs in a mount namespace of its own (unshare -m) with its
queue and spool on a small tmpfs.  Ten messages are accepted while the
destination answers 4xx, so they stay queued; then the tmpfs is filled to
the last byte from inside that namespace (nsenter).  A new message must get
451 4.3.0, the server must keep running, and once the filler is removed and the destination
accepts, the ten are delivered, a new message is answered 250 and delivered
too, the message refused with 451 is not, and the server stops cleanly
without a traceback.  (While the disk is full the queue manager cannot
record its deferrals; nothing here asserts how often it retries then.)
The postgres flavour, whose disk is PostgreSQL's, is test_serve_diskfull_pg.py.
"""

from __future__ import annotations

import re
import smtplib
import subprocess
from pathlib import Path

import pytest

from sluice.sink import Behaviour, Sink
from tests.integration.serving import free_port, start_serve_with, wait_until, write_serve_config
from tests.integration.stores import flavour_sections, skip_without_private_mounts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ID_RE = re.compile(rb"^X-Test-Id: (\w+)\r?$", re.MULTILINE)
BEFORE = 10


def message(ident: str, size: int = 1024) -> bytes:
    return (f"Subject: full disk {ident}\r\nX-Test-Id: {ident}\r\n\r\n".encode()
            + (b"0123456789abcdef" * 4 + b"\r\n") * (size // 66) + b"\r\n")


def send(port: int, ident: str, size: int = 1024) -> tuple[int, bytes]:
    with smtplib.SMTP("127.0.0.1", port, local_hostname="client.test", timeout=30) as c:
        c.ehlo()
        c.mail("a@sender.example")
        code, text = c.rcpt(f"{ident}@dest.example")
        if code != 250:
            return code, text
        return c.data(message(ident, size))


def tempfails(sink: Sink) -> int:
    return sum(n for (_, code), n in sink.snapshot().replies.items() if 400 <= code < 500)


@pytest.mark.parametrize("flavour", ["sqlite", "fs", "kv"])
def test_a_full_disk_answers_451_and_delivers_what_was_accepted(tmp_path: Path,
                                                                flavour: str) -> None:
    skip_without_private_mounts()
    small = tmp_path / "small"
    small.mkdir()
    sink = Sink(keep=True, default=Behaviour("tempfail"))
    sport = sink.start_in_thread()
    try:
        port = free_port()
        queue = {**flavour_sections(flavour, tmp_path)["queue"], "path": str(small / "queue"),
                 "spool": {"rootpath": str(small / "spool")}}
        config = write_serve_config(tmp_path, port, queue=queue, smtpd={"processes": 1},
                                    delivery={"transport": {"*": f"smtp:[127.0.0.1]:{sport}"}})
        wrapper = ("unshare", "-m", "--propagation", "private", "sh", "-c",
                   'mount -t tmpfs -o size=16m tmpfs "$0" && exec "$@"', str(small))
        srv = start_serve_with(config, tmp_path, port, wrapper=wrapper)
        inside = ("nsenter", "-t", str(srv.proc.pid), "-m", "sh", "-c")
        try:
            for i in range(BEFORE):
                reply = send(port, f"b{i}")
                assert reply[0] == 250, reply
            # Every one of them was tried and deferred at least once.
            assert wait_until(lambda: tempfails(sink) >= BEFORE, 60)
            # Fill the tmpfs (cat stops at ENOSPC), as seen from the server's namespace.
            subprocess.run([*inside, f'cat /dev/zero > "{small}/filler"; df -k "{small}"'],
                           check=False, capture_output=True, timeout=60)
            code, text = send(port, "full", size=100_000)
            assert (code, text[:5]) == (451, b"4.3.0")
            assert srv.proc.poll() is None
            # The operator frees space; the destination takes mail again.
            subprocess.run([*inside, f'rm "{small}/filler"'], check=True, timeout=60)
            sink.default = Behaviour("accept")
            assert wait_until(lambda: send(port, "after")[0] == 250, 30)

            def delivered() -> set[str]:
                return {m.decode() for msg in list(sink.messages)
                        for m in ID_RE.findall(msg.data)}

            want = {f"b{i}" for i in range(BEFORE)} | {"after"}
            assert wait_until(lambda: delivered() >= want, 120), sorted(want - delivered())
            assert "full" not in delivered()
        finally:
            code = srv.stop()
        assert code == 0
        log = "\n".join(srv.output)
        at = log.find("Traceback")
        assert at < 0, log[max(0, at - 500):at + 3000]
    finally:
        sink.stop_thread()
