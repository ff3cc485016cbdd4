"""bench/relay_floor.py relays what it takes in, byte for byte, and keeps it first.

The floor's figures in docs/floor.md only mean something if it does the
work it claims: every message reaches the next hop with its content
intact (dot-stuffing undone on the way in and done again on the way out),
the 250 comes once the journal (or the SQLite queue) holds the message,
and a failure stops it with one line.  A real SMTP client (smtplib, or a
raw socket), real next hops (the aiosmtpd sink, or a scripted one) over
loopback.
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
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice._loopback import free_port
from sluice.sink import Sink
from tests.integration.serving import wait_until

pytestmark = pytest.mark.integration

FLOOR = Path(__file__).resolve().parents[2] / "bench" / "relay_floor.py"
STORES = ["journal", "sqlite", "split"]

BODY = (b"From: a@sender.test\r\nTo: b@ok.test\r\nSubject: floor\r\n\r\n"
        b".leading dot\r\n..two dots\r\n.\r\nlast line\r\n")
#: A first line that starts with a dot (its own branch on either side).
DOTTED = b".first line\r\n" + BODY
#: Above the SQLite stores' inline limit (64 KiB): kept in a spool file of its own.
BIG = BODY + b"".join(b"line %06d of a big message, long enough\r\n" % i for i in range(2500))


def start_floor(tmp: Path, sink_port: int, store: str, *more: str
                ) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    options = ["--store", "sqlite", "--split"] if store == "split" else ["--store", store]
    proc = subprocess.Popen(
        [sys.executable, str(FLOOR), "--listen", f"127.0.0.1:{port}", "--sink-port",
         str(sink_port), "--dir", str(tmp / "store"), *options, *more],
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


def last_words(proc: subprocess.Popen[str], port: int, rcpt: str) -> str:
    """Send one message to ``rcpt``, then the floor's last line once it has stopped (rc 1)."""
    c = smtplib.SMTP("127.0.0.1", port, local_hostname="client.test", timeout=30)
    c.sendmail("a@sender.test", [rcpt], BODY)
    with contextlib.suppress(smtplib.SMTPServerDisconnected, ConnectionError):
        c.quit()  # the floor may be gone already
    c.close()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1, out
    return out.splitlines()[-1]


class ScriptedHop(socketserver.StreamRequestHandler):
    """A next hop: 250 to everything but RCPT TO:<refuse@...> (550); holds each
    message's 250 until ``release`` is set; closes the session after
    ``close_after`` messages (0: never).  Its hops' ``held`` counts the
    messages held at once, ``most_held`` the most ever."""

    def handle(self) -> None:
        srv: Hop = self.server  # type: ignore[assignment]
        self.wfile.write(b"220 hop.test\r\n")
        while line := self.rfile.readline():
            if line.upper().startswith(b"RCPT TO:<REFUSE@"):
                self.wfile.write(b"550 5.1.1 no such user\r\n")
            elif line.upper().startswith(b"DATA"):
                self.wfile.write(b"354 go on\r\n")
                while self.rfile.readline() not in (b".\r\n", b""):
                    pass
                with srv.count.lock:
                    srv.count.held += 1
                    srv.count.most_held = max(srv.count.most_held, srv.count.held)
                srv.release.wait(30)
                with srv.count.lock:
                    srv.count.held -= 1
                self.wfile.write(b"250 taken\r\n")
                srv.taken += 1
                if srv.close_after and srv.taken % srv.close_after == 0:
                    return  # the floor's session is idle now: closed under it
            else:
                self.wfile.write(b"250 ok\r\n")


class Held:
    """Messages held at once over a set of scripted hops."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held = 0
        self.most_held = 0


class Hop(socketserver.ThreadingTCPServer):
    daemon_threads = True

    def __init__(self, close_after: int = 0, addr: tuple[str, int] = ("127.0.0.1", 0),
                 release: threading.Event | None = None, count: Held | None = None) -> None:
        super().__init__(addr, ScriptedHop)
        if release is None:
            release = threading.Event()
            release.set()
        self.release = release
        self.count = count or Held()
        self.taken = 0
        self.close_after = close_after


@contextlib.contextmanager
def scripted_hop(close_after: int = 0, addr: tuple[str, int] = ("127.0.0.1", 0),
                 release: threading.Event | None = None, count: Held | None = None
                 ) -> Iterator[Hop]:
    hop = Hop(close_after, addr, release, count)
    threading.Thread(target=hop.serve_forever, daemon=True).start()
    try:
        yield hop
    finally:
        hop.release.set()
        hop.shutdown()
        hop.server_close()


@pytest.mark.parametrize("store", STORES)
def test_every_message_arrives_intact(tmp_path: Path, kept_sink: tuple[Sink, int],
                                      store: str) -> None:
    s, sink_port = kept_sink
    bodies = [BODY, BODY, BIG, BODY, DOTTED]
    proc, port = start_floor(tmp_path, sink_port, store)
    try:
        with smtplib.SMTP("127.0.0.1", port, local_hostname="client.test", timeout=30) as c:
            for i, body in enumerate(bodies):
                c.sendmail("a@sender.test", [f"b{i}@ok.test", f"c{i}@ok.test"], body)
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
        assert content == bodies[i]
    if store == "journal":
        journal = (tmp_path / "store" / "journal").read_bytes()
        # each delivery left its mark
        assert sorted(line for line in journal.split(b"\n") if line.startswith(b"D ")) == [
            b"D %d" % k for k in range(1, 6)]
    else:
        db = sqlite3.connect(tmp_path / "store" / "queue.db")
        try:
            assert db.execute("SELECT count(*) FROM queue").fetchone() == (0,)
            assert db.execute("SELECT count(*) FROM content").fetchone() == (0,)
            assert dict(db.execute("SELECT key, n FROM qstats")) == {
                k: 0 for k in ("hold", "incoming", "deferred", "active", "delivering",
                               "bounce", "messages")}
        finally:
            db.close()
        assert list((tmp_path / "store" / "spool").iterdir()) == []


@pytest.mark.parametrize("store", STORES)
def test_the_250_comes_once_the_message_is_kept(tmp_path: Path, store: str) -> None:
    with scripted_hop() as hop:
        hop.release.clear()  # nothing gets delivered, so nothing is deleted yet
        proc, port = start_floor(tmp_path, hop.server_address[1], store)
        try:
            with smtplib.SMTP("127.0.0.1", port, local_hostname="client.test",
                              timeout=30) as c:
                c.sendmail("a@sender.test", ["b@ok.test", "c@ok.test"], BIG)
                # the 250 is in: the message must be there now
                if store == "journal":
                    journal = (tmp_path / "store" / "journal").read_bytes()
                    assert journal.startswith(b"M 1 <a@sender.test> <b@ok.test> <c@ok.test> ")
                    assert BIG in journal
                else:
                    db = sqlite3.connect(tmp_path / "store" / "queue.db")
                    try:
                        rows = db.execute("SELECT recipient, domain, sender FROM queue "
                                          "ORDER BY idx").fetchall()
                    finally:
                        db.close()
                    assert rows == [("b@ok.test", "ok.test", "a@sender.test"),
                                    ("c@ok.test", "ok.test", "a@sender.test")]
                    (spooled,) = (tmp_path / "store" / "spool").iterdir()
                    assert spooled.read_bytes() == BIG
                hop.release.set()
                assert wait_until(lambda: hop.taken == 1, 30)
        finally:
            out = stop(proc)
    assert proc.returncode == 0, out


def test_an_empty_message_is_ended_by_its_dot(tmp_path: Path,
                                              kept_sink: tuple[Sink, int]) -> None:
    s, sink_port = kept_sink
    proc, port = start_floor(tmp_path, sink_port, "journal")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
            f = c.makefile("rb")
            assert f.readline().startswith(b"220")
            for command in (b"HELO c.test", b"MAIL FROM:<a@sender.test>", b"RCPT TO:<b@ok.test>"):
                c.sendall(command + b"\r\n")
                assert f.readline().startswith(b"250")
            c.sendall(b"DATA\r\n")
            assert f.readline().startswith(b"354")
            c.sendall(b".\r\n")
            assert f.readline().startswith(b"250")
            c.sendall(b"NOOP\r\n")  # a command again, not more of the message
            assert f.readline().startswith(b"250")
        assert wait_until(lambda: len(s.messages) == 1, 30)
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out
    assert s.messages[0].data.startswith(b"Received: from client by floor.test; ")
    assert s.messages[0].data.count(b"\r\n") == 1


def test_an_unreachable_next_hop_stops_the_floor_with_the_reason(tmp_path: Path) -> None:
    nobody = free_port()  # nothing listens there: the first delivery cannot connect
    proc, port = start_floor(tmp_path, nobody, "journal")
    assert last_words(proc, port, "b@ok.test") == (
        f"relay_floor: cannot connect to 127.0.0.1:{nobody}: "
        "[Errno 111] Connection refused")


def test_a_refused_recipient_stops_the_floor_with_the_reply(tmp_path: Path) -> None:
    with scripted_hop() as hop:
        proc, port = start_floor(tmp_path, hop.server_address[1], "split")
        last = last_words(proc, port, "refuse@ok.test")
    assert last == (
        "relay_floor: 127.0.0.1 answered b'550 5.1.1 no such user' in data")
    assert not _listening(port)  # the receiving child went with it


def test_a_next_hop_closing_a_kept_session_is_no_failure(tmp_path: Path) -> None:
    # The benchmark's harness stops its sink once the count is reached; the
    # floor must outlive that, as an MTA does, for thread_cpu.py to read its
    # threads afterwards.
    with scripted_hop(close_after=1) as hop:
        proc, port = start_floor(tmp_path, hop.server_address[1], "split")
        try:
            with smtplib.SMTP("127.0.0.1", port, local_hostname="client.test",
                              timeout=30) as c:
                c.sendmail("a@sender.test", ["b@ok.test"], BODY)
                assert wait_until(lambda: hop.taken == 1, 30)
                assert not wait_until(lambda: proc.poll() is not None, 1.0)
                c.sendmail("a@sender.test", ["c@ok.test"], BODY)  # on a new session
                assert wait_until(lambda: hop.taken == 2, 30)
        finally:
            out = stop(proc)
    assert proc.returncode == 0, out


def test_sessions_open_at_once_are_bounded_over_all_next_hops(tmp_path: Path) -> None:
    # Five domains, each its own next hop (dK.test to 127.10.0.K, as the
    # many mix routes them), at most two sessions open in all: while the
    # hops hold their 250s, two messages are out and the other three wait
    # for a place; once released, every one arrives.
    release, count = threading.Event(), Held()
    with contextlib.ExitStack() as hops:
        first = hops.enter_context(scripted_hop(addr=("127.10.0.1", 0), release=release,
                                                count=count))
        port = first.server_address[1]
        every = [first] + [hops.enter_context(scripted_hop(addr=(f"127.10.0.{k}", port),
                                                           release=release, count=count))
                           for k in range(2, 6)]
        proc, listen = start_floor(tmp_path, port, "split", "--hops", "--open-max", "2")
        try:
            with smtplib.SMTP("127.0.0.1", listen, local_hostname="client.test",
                              timeout=30) as c:
                for k in range(1, 6):
                    c.sendmail("a@sender.test", [f"user@d{k}.test"], BODY)
            assert wait_until(lambda: count.held == 2, 30)
            assert not wait_until(lambda: count.held > 2, 1.0)
            release.set()
            assert wait_until(lambda: sum(h.taken for h in every) == 5, 30)
            assert [h.taken for h in every] == [1] * 5
            assert count.most_held == 2
        finally:
            out = stop(proc)
    assert proc.returncode == 0, out


def test_at_the_bound_the_oldest_idle_session_makes_room(tmp_path: Path) -> None:
    # Two places, both held by idle sessions kept after their messages (the
    # scripted hops never close one): a third next hop gets its session only
    # because the floor closes the one idle longest.
    with contextlib.ExitStack() as hops:
        first = hops.enter_context(scripted_hop(addr=("127.10.0.1", 0)))
        port = first.server_address[1]
        every = [first] + [hops.enter_context(scripted_hop(addr=(f"127.10.0.{k}", port)))
                           for k in (2, 3)]
        proc, listen = start_floor(tmp_path, port, "journal", "--hops", "--open-max", "2")
        try:
            with smtplib.SMTP("127.0.0.1", listen, local_hostname="client.test",
                              timeout=30) as c:
                for k, hop in enumerate(every, 1):
                    c.sendmail("a@sender.test", [f"user@d{k}.test"], BODY)
                    assert wait_until(lambda hop=hop: hop.taken == 1, 30), k
        finally:
            out = stop(proc)
    assert proc.returncode == 0, out


def test_a_next_hop_that_never_greets_stops_the_floor(tmp_path: Path) -> None:
    # A connect the next hop's kernel completed but nobody accepts (as when
    # its listen queue overflows): no banner comes, and the floor says so.
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        proc, port = start_floor(tmp_path, mute.getsockname()[1], "journal",
                                 "--banner-timeout", "0.5")
        last = last_words(proc, port, "b@ok.test")
    assert last == "relay_floor: no banner from 127.0.0.1 in 0.5 s"


def test_a_used_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "journal").write_bytes(b"M 1 ...\n")
    proc = subprocess.run(
        [sys.executable, str(FLOOR), "--listen", f"127.0.0.1:{free_port()}",
         "--dir", str(tmp_path / "store")],
        cwd=FLOOR.parent, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"relay_floor: --dir {tmp_path / 'store'} is not empty "
                                   "(message numbers restart at 1)")
