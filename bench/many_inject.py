#!/usr/bin/env python3
"""Injector of the many-destinations mix: N messages, S SMTP sessions, round robin over D domains.

    python bench/many_inject.py --port 2528 [--n 20000] [--sessions 20]
                                [--domains 10000] [--size 1024] [--wait-go]

smtp-source (Postfix's) gives every message of one process the same
recipient domain, so it cannot spread mail over 10,000 destinations.  This
injector talks as `smtp-source -d -N` does -- HELO once per session, then per
message MAIL, RCPT, DATA and the content, each waiting for its reply (no
pipelining), QUIT at the end; the content is smtp-source's (From, To, Date
and Message-Id headers, then SIZE bytes in 80-byte lines) -- except that
message i goes to `{i}rcpt@d{i % D + 1}.test`.

Cheap by construction, so that it takes little from the machine the MTA
runs on: one thread, epoll over S blocking sockets, every command a
prebuilt bytes object (the few per-message ones are one `%` format); per
message four sends and four receives, and no other Python than the reply
check.  It counts the messages accepted (250 after the content).

With --wait-go it builds everything, then waits for a line on stdin before
it connects, so that a driver's clock starts when the work does.

Last line:
    inject accepted=N sessions=S domains=D elapsed_s=.. cpu_s=..
where cpu_s is its own CPU time from the go to the end.  Exit status 1 (and
the offending reply on stderr) when any reply is not the one expected.
"""

from __future__ import annotations

import argparse
import resource
import select
import socket
import struct
import sys
import time

# The reply each state waits for, and the state it moves to on that reply.
BANNER, HELO, MAIL, RCPT, DATA, CONTENT, QUIT = range(7)
EXPECT = {BANNER: b"220", HELO: b"250", MAIL: b"250", RCPT: b"250", DATA: b"354",
          CONTENT: b"250", QUIT: b"221"}


def body(size: int) -> bytes:
    """smtp-source's payload: SIZE bytes (CRLFs included) in numbered 80-byte lines."""
    lines, left, i = [], size, 1
    while left > 2:
        line = (str(i) + "X" * 77)[:min(78, left - 2)]
        lines.append(line.encode() + b"\r\n")
        left -= len(line) + 2
        i += 1
    return b"".join(lines)


class Session:
    """One SMTP session and its state; `sock` is blocking, read only when ready."""

    __slots__ = ("buf", "sock", "state")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.state = BANNER
        self.buf = b""


class Injector:
    """Sends `n` messages round robin over `domains` through `sessions` sessions."""

    def __init__(self, port: int, n: int, sessions: int, domains: int, size: int,
                 host: str = "127.0.0.1") -> None:
        self.addr = (host, port)
        self.n, self.sessions, self.domains = n, sessions, domains
        self.next_msg = 0  # messages handed out so far (the next one's index)
        self.accepted = 0
        self.helo = b"HELO src.example\r\n"
        self.mail = b"MAIL FROM:<bench@src.example>\r\n"
        self.data = b"DATA\r\n"
        self.quit = b"QUIT\r\n"
        self.rcpt = b"RCPT TO:<%drcpt@d%d.test>\r\n"
        self.content = (b"From: <bench@src.example>\r\nTo: <rcpt@d%d.test>\r\n"
                        b"Date: " + time.strftime("%a, %d %b %Y %H:%M:%S +0000 (UTC)",
                                                  time.gmtime()).encode()
                        + b"\r\nMessage-Id: <%d.bench@src.example>\r\n\r\n"
                        + body(size).replace(b"%", b"%%") + b".\r\n")
        self.current: dict[int, int] = {}  # fd -> index of the message it sends

    def _start_message(self, fd: int, s: Session) -> None:
        if self.next_msg >= self.n:
            s.state = QUIT
            s.sock.sendall(self.quit)
            return
        self.current[fd] = self.next_msg
        self.next_msg += 1
        s.state = MAIL
        s.sock.sendall(self.mail)

    def _advance(self, fd: int, s: Session) -> bool:
        """Act on a complete reply in s.buf; False when the session is done."""
        reply, s.buf = s.buf, b""
        if reply[:3] != EXPECT[s.state]:
            raise RuntimeError(f"session {fd}: state {s.state} expected {EXPECT[s.state]!r}, "
                               f"got {reply[:200]!r}")
        st = s.state
        if st == BANNER:
            s.state = HELO
            s.sock.sendall(self.helo)
        elif st == HELO:
            self._start_message(fd, s)
        elif st == MAIL:
            i = self.current[fd]
            s.state = RCPT
            s.sock.sendall(self.rcpt % (i, i % self.domains + 1))
        elif st == RCPT:
            s.state = DATA
            s.sock.sendall(self.data)
        elif st == DATA:
            i = self.current[fd]
            s.state = CONTENT
            s.sock.sendall(self.content % (i % self.domains + 1, i))
        elif st == CONTENT:
            self.accepted += 1
            self._start_message(fd, s)
        else:  # QUIT answered
            return False
        return True

    def run(self, timeout: float) -> None:
        """Send everything; raise on a wrong reply, a closed session or the timeout."""
        deadline = time.monotonic() + timeout
        ep = select.epoll()
        live: dict[int, Session] = {}
        for _ in range(min(self.sessions, max(self.n, 1))):
            sock = socket.create_connection(self.addr)
            # a send that cannot finish in 60 s fails instead of hanging the run
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 60, 0))
            live[sock.fileno()] = Session(sock)
            ep.register(sock.fileno(), select.EPOLLIN)
        try:
            while live:
                events = ep.poll(1.0)
                if not events and time.monotonic() > deadline:
                    raise RuntimeError(f"timeout: {self.accepted} accepted")
                for fd, _ev in events:
                    s = live[fd]
                    data = s.sock.recv(65536)
                    if not data:
                        raise RuntimeError(f"session {fd} closed by the server "
                                           f"in state {s.state}")
                    s.buf += data
                    buf = s.buf
                    if not buf.endswith(b"\r\n"):
                        continue
                    last = buf.rfind(b"\n", 0, len(buf) - 1) + 1
                    if buf[last + 3:last + 4] == b"-":
                        continue  # a multi-line reply goes on
                    if not self._advance(fd, s):
                        ep.unregister(fd)
                        s.sock.close()
                        del live[fd]
        finally:
            for s in live.values():
                s.sock.close()
            ep.close()


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True, help="the MTA's port on 127.0.0.1")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--domains", type=int, default=10000)
    ap.add_argument("--size", type=int, default=1024, help="payload bytes (smtp-source -l)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--wait-go", action="store_true",
                    help="wait for a line on stdin before connecting")
    a = ap.parse_args()
    inj = Injector(a.port, a.n, a.sessions, a.domains, a.size)
    if a.wait_go:
        sys.stdin.readline()
    c0, t0 = cpu_s(), time.monotonic()
    try:
        inj.run(a.timeout)
    except (OSError, RuntimeError) as exc:
        print(f"inject: {exc} (accepted {inj.accepted})", file=sys.stderr, flush=True)
        sys.exit(1)
    print(f"inject accepted={inj.accepted} sessions={a.sessions} domains={a.domains} "
          f"elapsed_s={time.monotonic() - t0:.3f} cpu_s={cpu_s() - c0:.3f}", flush=True)
    if inj.accepted != a.n:
        sys.exit(1)


if __name__ == "__main__":
    main()
