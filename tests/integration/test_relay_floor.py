"""bench/relay_floor.py relays what it takes in, byte for byte, and keeps it first.

The floor's figures in docs/benchmarks.md only mean something if it does
the work it claims: every message reaches the next hop with its content
intact (dot-stuffing undone on the way in and done again on the way out),
and the 250 comes after the journal (or the SQLite queue) holds the
message.  A real SMTP client (smtplib) and a real next hop (the aiosmtpd
sink) over loopback.
"""

from __future__ import annotations

import contextlib
import smtplib
import socket
import socketserver
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sluice._loopback import free_port
from sluice.sink import Sink
from tests.integration.serving import wait_until

pytestmark = pytest.mark.integration

FLOOR = Path(__file__).resolve().parents[2] / "bench" / "relay_floor.py"

BODY = (b"From: a@sender.test\r\nTo: b@ok.test\r\nSubject: floor\r\n\r\n"
        b".leading dot\r\n..two dots\r\n.\r\nlast line\r\n")
#: Above the SQLite stores' inline limit (64 KiB): kept in a spool file of its own.
BIG = BODY + b"".join(b"line %06d of a big message, long enough\r\n" % i for i in range(2500))


def start_floor(tmp: Path, sink_port: int, store: str) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    options = ["--store", "sqlite", "--split"] if store == "split" else ["--store", store]
    proc = subprocess.Popen(
        [sys.executable, str(FLOOR), "--listen", f"127.0.0.1:{port}", "--sink-port",
         str(sink_port), "--dir", str(tmp / "store"), *options],
        cwd=FLOOR.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "serving SMTP" in line, line + proc.stdout.read()
    return proc, port


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def stop(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    return out


@pytest.mark.parametrize("store", ["journal", "sqlite", "split"])
def test_every_message_arrives_intact_and_was_kept_first(
        tmp_path: Path, kept_sink: tuple[Sink, int], store: str) -> None:
    s, sink_port = kept_sink
    proc, port = start_floor(tmp_path, sink_port, store)
    try:
        with smtplib.SMTP("127.0.0.1", port, local_hostname="client.test", timeout=30) as c:
            for i in range(5):
                c.sendmail("a@sender.test", [f"b{i}@ok.test", f"c{i}@ok.test"],
                           BIG if i == 2 else BODY)
        assert wait_until(lambda: len(s.messages) == 5, 30), len(s.messages)
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out
    # with --split, SIGTERM to the first process stops the receiving one too
    assert not _listening(port)
    for i, m in enumerate(sorted(s.messages, key=lambda m: m.recipients)):
        assert m.sender == "a@sender.test"
        assert m.recipients == (f"b{i}@ok.test", f"c{i}@ok.test")
        received, _, content = m.data.partition(b"\r\n")
        assert received.startswith(b"Received: from client by floor.test; ")
        assert content == (BIG if i == 2 else BODY)
    if store == "journal":
        journal = (tmp_path / "store" / "journal").read_bytes()
        # each message's record holds its content, and each delivery left its mark
        assert journal.count(BODY) == 5 and journal.count(BIG) == 1
        assert sorted(line for line in journal.split(b"\n") if line.startswith(b"D ")) == [
            b"D %d" % k for k in range(1, 6)]
    else:
        db = sqlite3.connect(tmp_path / "store" / "queue.db")
        try:
            assert db.execute("SELECT count(*) FROM queue").fetchone() == (0,)
            assert db.execute("SELECT count(*) FROM content").fetchone() == (0,)
            # the big content went to a file of its own, gone once delivered
            assert list((tmp_path / "store" / "spool").iterdir()) == []
            assert dict(db.execute("SELECT key, n FROM qstats")) == {
                k: 0 for k in ("hold", "incoming", "deferred", "active", "delivering",
                               "bounce", "messages")}
        finally:
            db.close()


def test_a_refused_message_stops_the_floor_with_the_reason(tmp_path: Path) -> None:
    nobody = free_port()  # nothing listens there: the first delivery cannot connect
    proc, port = start_floor(tmp_path, nobody, "journal")
    c = smtplib.SMTP("127.0.0.1", port, local_hostname="client.test", timeout=30)
    c.sendmail("a@sender.test", ["b@ok.test"], BODY)
    with contextlib.suppress(smtplib.SMTPServerDisconnected, ConnectionError):
        c.quit()  # the floor may be gone already
    c.close()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert f"cannot connect to 127.0.0.1:{nobody}" in out


class OneMessageHop(socketserver.StreamRequestHandler):
    """A next hop that takes one message, then closes the session, as a sink stopping does."""

    def handle(self) -> None:
        self.wfile.write(b"220 hop.test\r\n")
        while line := self.rfile.readline():
            if line.upper().startswith(b"DATA"):
                self.wfile.write(b"354 go on\r\n")
                while self.rfile.readline() not in (b".\r\n", b""):
                    pass
                self.wfile.write(b"250 taken\r\n")
                self.server.taken += 1  # type: ignore[attr-defined]
                return  # the floor's session is idle now: closed under it
            self.wfile.write(b"250 ok\r\n")


def test_a_next_hop_closing_a_kept_session_is_no_failure(tmp_path: Path) -> None:
    # The benchmark's harness stops its sink once the count is reached; the
    # floor must outlive that, as an MTA does, for thread_cpu.py to read its
    # threads afterwards.  A session lost in the middle of a message still
    # stops it (test_a_refused_message_stops_the_floor_with_the_reason).
    hop = socketserver.ThreadingTCPServer(("127.0.0.1", 0), OneMessageHop)
    hop.taken = 0  # type: ignore[attr-defined]
    threading.Thread(target=hop.serve_forever, daemon=True).start()
    proc, port = start_floor(tmp_path, hop.server_address[1], "split")
    try:
        with smtplib.SMTP("127.0.0.1", port, local_hostname="client.test", timeout=30) as c:
            c.sendmail("a@sender.test", ["b@ok.test"], BODY)
            assert wait_until(lambda: hop.taken == 1, 30)  # type: ignore[attr-defined]
            assert not wait_until(lambda: proc.poll() is not None, 1.0), proc.communicate()[0]
            c.sendmail("a@sender.test", ["c@ok.test"], BODY)  # on a new session
            assert wait_until(lambda: hop.taken == 2, 30)  # type: ignore[attr-defined]
    finally:
        out = stop(proc)
        hop.shutdown()
        hop.server_close()
    assert proc.returncode == 0, out
