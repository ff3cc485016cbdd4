#!/usr/bin/env python3
"""The floor: the least a Python relay must do per message, with the same durability.

    .venv/bin/python bench/relay_floor.py --listen 127.0.0.1:2528 --sink-port 2526
        --dir NEW_DIR [--store journal|sqlite] [--split] [--hops] [--per-hop 20]
        [--open-max 200] [--banner-timeout 30]
    .venv/bin/python bench/e2e.py --configs base --floor   # runs it beside Sluice

DESCRIPTION
    A store-and-forward SMTP relay reduced to what its promises and the
    benchmark need, so that its CPU a message is a floor under any MTA
    written in Python on this machine (uvloop, CPython):

    - receiving: an asyncio Protocol that answers HELO/EHLO, MAIL, RCPT,
      DATA, RSET, NOOP and QUIT one command at a time, finds the end of the
      data with one search a chunk and undoes the dot-stuffing with one
      bytes.replace;
    - durability: the 250 for the data is written only once the message is
      on stable storage (bench/floor_stores.py: a journal, or Sluice's own
      SQLite queue, which also keeps Sluice's promises on the way out);
    - forwarding: a Received: line in front, then to the next hop over kept
      sessions (up to --per-hop a hop, at most OPEN_MAX open and IDLE_MAX
      idle in all), MAIL,
      RCPT and DATA in one write (the sink offers PIPELINING), after the
      354 the content in a second.

    What it leaves out is everything an MTA is for beyond that: a queue
    that can be listed, counted, held or retried, policies and their
    limits, scheduling and fairness, retries, bounces, DSNs, accounting
    lines, message ids, TLS, authentication.  A failed reply from the next
    hop, or a session lost in the middle of a message, ends the relay with
    an error; there is no retry.  So the floor is not a competitor: its
    figures say how much of an MTA's CPU a message the language, the event
    loop and the kernel take before the MTA has done anything of its own.

    --store sqlite keeps the messages in Sluice's SQLite schema; --split
    then receives in a forked child and claims and sends from the first
    process, as Sluice's receivers and queue manager do.  --hops routes
    each recipient domain dK.test to its own next hop 127.10.X.Y
    (bench/many_routes.py), as the "many" configs of bench/e2e.py do;
    without it everything goes to 127.0.0.1:--sink-port.  --dir must be
    new or empty.  It prints "serving SMTP" once it listens, stops on
    SIGTERM (the child with it), and exits 1 with one line on a failure.

STRATEGIES
    Callbacks, not coroutines: each connection is a state machine fed by
    data_received, and a store answers through callbacks the loop runs,
    so no task or future is made per message (a session opened for
    --hops is a task of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from email.utils import formatdate
from pathlib import Path

import many_routes
from floor_stores import Claimer, Journal, Message, SqliteQueue, Writer, create_schema

END = b"\r\n.\r\n"


class Server(asyncio.Protocol):
    """One receiving connection."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.buf = b""
        self.in_data = False
        self.sender = b""
        self.rcpts: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(b"220 floor ESMTP\r\n")  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        # where the end of the data could start that an earlier search has not seen
        start = max(0, len(self.buf) - 4)
        buf = self.buf + data if self.buf else data
        write = self.transport.write  # type: ignore[union-attr]
        while buf:
            if self.in_data:
                # buf starts with the CRLF put before the data (DATA below)
                end = buf.find(END, start)
                start = 0
                if end < 0:
                    self.buf = buf
                    return
                body = buf[:end + 2].replace(b"\r\n..", b"\r\n.")[2:]
                buf = buf[end + 5:]
                self.in_data = False
                self.relay.received(self.sender, self.rcpts, body, write)
                self.rcpts = []
                continue
            eol = buf.find(b"\r\n")
            if eol < 0:
                self.buf = buf
                return
            line, buf = buf[:eol], buf[eol + 2:]
            start = 0
            verb = line[:4].upper()
            if verb == b"MAIL":
                self.sender = line[10:].strip()
                write(b"250 2.1.0 Ok\r\n")
            elif verb == b"RCPT":
                self.rcpts.append(line[8:].strip())
                write(b"250 2.1.5 Ok\r\n")
            elif verb == b"DATA":
                self.in_data = True
                # The data starts a line: with a CRLF before it, one search
                # finds its end even right away (an empty message), and one
                # replace undoes the stuffing of its first line too.
                buf = b"\r\n" + buf
                write(b"354 End data with <CR><LF>.<CR><LF>\r\n")
            elif verb in (b"HELO", b"EHLO"):
                write(b"250 floor\r\n")
            elif verb == b"RSET":
                self.rcpts = []
                write(b"250 2.0.0 Ok\r\n")
            elif verb == b"QUIT":
                write(b"221 2.0.0 Bye\r\n")
                self.transport.close()  # type: ignore[union-attr]
                self.buf = b""
                return
            else:
                write(b"250 2.0.0 Ok\r\n")
        self.buf = b""


class Client(asyncio.Protocol):
    """One kept session to a next hop: banner, EHLO, then transactions."""

    def __init__(self, hop: Hop) -> None:
        self.hop = hop
        self.buf = b""
        self.expect = 1  # replies still to come for the current step
        self.step = "banner"
        self.failed: bytes | None = None
        self.msg: Message | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        # A next hop may close a kept session (the harness stops its sink):
        # no failure once the message is delivered.
        if self.step == "idle":
            self.hop.unidle(self)
            self.hop.closed()
        elif self.step == "recording":  # Hop.ready sees it when the record is in
            self.step = "lost"
        elif self.step != "closed":
            self.hop.relay.fail(f"session to {self.hop.addr} lost in {self.step}: {exc}")

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        while True:
            eol = buf.find(b"\r\n")
            if eol < 0:
                break
            line, buf = buf[:eol], buf[eol + 2:]
            if line[3:4] == b"-":
                continue
            code = line[:1]
            # the last reply of the MAIL, RCPT, DATA step is DATA's 354
            want = b"3" if self.step == "data" and self.expect == 1 else b"2"
            if code != want and self.failed is None:
                self.failed = line  # the first reply that went wrong names the failure
            self.expect -= 1
            if self.expect == 0:
                self._step_done(line)
        self.buf = buf

    def _step_done(self, line: bytes) -> None:
        if self.failed is not None:
            self.hop.relay.fail(f"{self.hop.addr} answered {self.failed!r} in {self.step}")
            return
        t = self.transport
        assert t is not None
        if self.step == "banner":
            self.step, self.expect = "ehlo", 1
            t.write(b"EHLO floor.test\r\n")
        elif self.step == "ehlo":
            self.hop.ready(self)
        elif self.step == "data":
            msg = self.msg
            assert msg is not None
            self.step, self.expect = "content", 1
            # the attempt's mark first, as Sluice waits for it after the 354
            content = self.hop.relay.stamped(msg.content)
            self.hop.relay.store.sending(msg, lambda: t.write(content))
        elif self.step == "content":
            msg = self.msg
            assert msg is not None
            self.msg = None
            self.step = "recording"
            # the success kept before the session is reused, as Sluice does
            self.hop.relay.store.delivered(msg, lambda: self.hop.ready(self))

    def send(self, msg: Message) -> None:
        self.msg = msg
        self.step = "data"
        self.expect = 2 + len(msg.rcpts)
        parts = [b"MAIL FROM:", msg.sender, b"\r\n"]
        for r in msg.rcpts:
            parts += [b"RCPT TO:", r, b"\r\n"]
        parts.append(b"DATA\r\n")
        self.transport.write(b"".join(parts))  # type: ignore[union-attr]

    def quit(self) -> None:
        self.step = "closed"
        if self.transport is not None:
            self.transport.write(b"QUIT\r\n")
            self.transport.close()

    def greeted(self) -> None:
        """Fail when the banner has not come (a connect the next hop never accepted)."""
        if self.step == "banner":
            self.hop.relay.fail(f"no banner from {self.hop.addr} in {self.hop.relay.banner_s:g} s")


#: Sessions open or opening at once, over all next hops (--open-max):
#: Sluice's delivery.max_connections, which bounds its deliveries in flight
#: too.  Without a bound, a claim of a few hundred messages to as many hops
#: opened as many connections at once, more than the sink's listen queue
#: took, and the floor waited for banners that never came.
OPEN_MAX = 200
#: Sessions kept open with nothing to send, over all next hops (Sluice's
#: connection cache keeps idle sessions too; beyond this one is closed).
IDLE_MAX = 200
#: How long a new session may wait for its banner before the floor fails
#: (--banner-timeout).
BANNER_S = 30.0


class Hop:
    """A next hop: its waiting messages and its sessions."""

    def __init__(self, relay: Relay, addr: str, port: int, per_hop: int) -> None:
        self.relay = relay
        self.addr = addr
        self.port = port
        self.per_hop = per_hop
        self.waiting: collections.deque[Message] = collections.deque()
        self.idle: list[Client] = []
        self.sessions = 0
        self.queued = False  # in the relay's queue for a place (Relay.wanting)

    def submit(self, msg: Message) -> None:
        if self.idle:
            client = self.idle[-1]
            self.unidle(client)
            client.send(msg)
            return
        self.waiting.append(msg)
        if self.sessions < self.per_hop and not self.queued:
            self.relay.want(self)

    def unidle(self, client: Client) -> None:
        """``client`` stops being idle (it sends, or it is gone)."""
        self.idle.remove(client)
        del self.relay.idle[client]

    def wants(self) -> bool:
        """Whether a message waits that no session of this hop will take."""
        return len(self.waiting) > self.sessions - len(self.idle) and self.sessions < self.per_hop

    def open(self) -> None:
        """Open one more session (the relay has counted it)."""
        self.sessions += 1
        self.relay.loop.create_task(self._open())

    def closed(self) -> None:
        """One session of this hop is gone: its place goes to a hop that wants one."""
        self.sessions -= 1
        self.relay.freed()

    async def _open(self) -> None:
        loop = self.relay.loop
        try:
            async with asyncio.timeout(self.relay.banner_s):  # a SYN nobody answers
                _, client = await loop.create_connection(lambda: Client(self), self.addr,
                                                         self.port)
        except TimeoutError:
            self.relay.fail(f"no connection to {self.addr} in {self.relay.banner_s:g} s")
            return
        except OSError as exc:
            self.relay.fail(f"cannot connect to {self.addr}:{self.port}: {exc}")
            return
        loop.call_later(self.relay.banner_s, client.greeted)

    def ready(self, client: Client) -> None:
        if client.step == "lost":  # its place goes to a new session, if one is wanted
            if self.waiting:
                self.relay.loop.create_task(self._open())
            else:
                self.closed()
            return
        relay = self.relay
        if self.waiting:
            client.send(self.waiting.popleft())
            return
        while relay.wanting and not relay.wanting[0].wants():  # its own sessions took them
            relay.wanting.popleft().queued = False
        if len(relay.idle) < IDLE_MAX and not relay.wanting:
            client.step = "idle"
            self.idle.append(client)
            relay.idle[client] = None
        else:  # its place is wanted elsewhere, or enough sessions idle
            client.quit()
            self.closed()


class Relay:
    """The receiving side's messages into the journal, then out to their hops."""

    def __init__(self, loop: asyncio.AbstractEventLoop, store: Writer, sink_port: int,
                 hops: bool, per_hop: int, stop: asyncio.Future[str],
                 forward: bool = True, open_max: int = OPEN_MAX,
                 banner_s: float = BANNER_S) -> None:
        self.loop = loop
        self.forward = forward
        self.store = store
        self.sink_port = sink_port
        self.by_domain = hops
        self.per_hop = per_hop
        self.stop = stop
        self.hops: dict[str, Hop] = {}
        self.open_max = open_max
        self.banner_s = banner_s
        self.open = 0  # sessions open or opening, all hops (at most open_max)
        self.idle: dict[Client, None] = {}  # kept with nothing to send, oldest first
        self.wanting: collections.deque[Hop] = collections.deque()  # waiting for a place
        self.next_mid = 0
        self.stamp_at = 0
        self.stamp = b""

    def received(self, sender: bytes, rcpts: list[bytes], content: bytes,
                 write: Callable[[bytes], None]) -> None:
        self.next_mid += 1
        msg = Message(sender, rcpts, content, self.next_mid)

        def durable() -> None:
            write(b"250 2.0.0 Ok: queued\r\n")
            if self.forward:  # else the other process claims it (--split)
                self.route(msg)

        self.store.received(msg, durable)

    def route(self, msg: Message) -> None:
        addr = "127.0.0.1"
        if self.by_domain:
            # each message of this mix has one recipient: <user@dK.test>
            domain = msg.rcpts[0].rstrip(b">").rpartition(b"@")[2]
            addr = many_routes.nexthop(int(domain[1:].split(b".")[0]))
        hop = self.hops.get(addr)
        if hop is None:
            hop = self.hops[addr] = Hop(self, addr, self.sink_port, self.per_hop)
        hop.submit(msg)

    def want(self, hop: Hop) -> None:
        """``hop`` wants one more session: a free place, else the longest idle one's."""
        if self.open < self.open_max:
            self.open += 1
        elif self.idle:  # the place passes from the closed session to the new one
            oldest = next(iter(self.idle))
            oldest.hop.unidle(oldest)
            oldest.hop.sessions -= 1
            oldest.quit()
        else:
            hop.queued = True
            self.wanting.append(hop)
            return
        hop.open()

    def freed(self) -> None:
        """A session closed: its place goes to the first hop still wanting one."""
        self.open -= 1
        while self.wanting and self.open < self.open_max:
            hop = self.wanting.popleft()
            hop.queued = False
            if hop.wants():
                self.open += 1
                hop.open()
                if hop.wants():  # more waiting than it has sessions: back in line
                    hop.queued = True
                    self.wanting.append(hop)

    def stamped(self, content: bytes) -> bytes:
        now = int(time.time())
        if now != self.stamp_at:
            self.stamp_at = now
            self.stamp = (b"Received: from client by floor.test; "
                          + formatdate(now).encode() + b"\r\n")
        # (bytes.replace returns the content itself when there is no dot line)
        content = content.replace(b"\r\n.", b"\r\n..")
        if content.startswith(b"."):
            content = b"." + content
        return self.stamp + content + b".\r\n"

    def fail(self, why: str) -> None:
        if not self.stop.done():
            self.stop.set_result(why)


class Claims:
    """The sending process of --split: a byte on the pipe, then a claim of what arrived."""

    def __init__(self, relay: Relay, claimer: Claimer, wake: int) -> None:
        self.relay = relay
        self.claimer = claimer
        self.wake = wake
        self.busy = False
        self.again = False
        relay.loop.add_reader(wake, self._woken)

    def _woken(self) -> None:
        if not os.read(self.wake, 65536):
            self.relay.loop.remove_reader(self.wake)
            self.relay.fail("the receiving process is gone")
            return
        if self.busy:
            self.again = True
        else:
            self.busy = True
            self.claimer.claim(self._claimed)

    def _claimed(self, messages: list[Message], more: bool) -> None:
        for msg in messages:
            self.relay.route(msg)
        if self.again or more:
            self.again = False
            self.claimer.claim(self._claimed)
        else:
            self.busy = False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", default="127.0.0.1:2528", help="HOST:PORT to receive on")
    ap.add_argument("--sink-port", type=int, default=2526, help="the next hops' port")
    ap.add_argument("--dir", type=Path, required=True,
                    help="directory for the journal or the SQLite queue")
    ap.add_argument("--store", choices=("journal", "sqlite"), default="journal",
                    help="an append-only journal, or Sluice's SQLite schema and statements")
    ap.add_argument("--split", action="store_true",
                    help="(sqlite) receive in one process, claim and send from another")
    ap.add_argument("--hops", action="store_true", help="dK.test to 127.10.X.Y (many mix)")
    ap.add_argument("--per-hop", type=int, default=20, help="sessions a next hop at most")
    ap.add_argument("--open-max", type=int, default=OPEN_MAX,
                    help="sessions open at once over all next hops (Sluice's default)")
    ap.add_argument("--banner-timeout", type=float, default=BANNER_S,
                    help="seconds a new session waits for its banner before the floor fails")
    args = ap.parse_args()
    if args.open_max < 1 or args.per_hop < 1 or args.banner_timeout <= 0:
        ap.error("--open-max and --per-hop must be at least 1, --banner-timeout above 0")
    if args.split and args.store != "sqlite":
        ap.error("--split needs --store sqlite: the two processes share its queue")
    args.dir.mkdir(parents=True, exist_ok=True)
    if any(args.dir.iterdir()):
        sys.exit(f"relay_floor: --dir {args.dir} is not empty (message numbers restart at 1)")
    if not args.split:
        run(lambda loop: Journal(args.dir / "journal", loop) if args.store == "journal"
            else SqliteQueue(args.dir / "queue.db", loop), args, receive=True)
        return
    db = args.dir / "queue.db"
    create_schema(db)
    wake, woken = os.pipe()
    child = os.fork()  # no thread runs yet
    if child == 0:
        os.close(wake)
        _die_with_parent()
        run(lambda loop: SqliteQueue(db, loop, notify=woken), args, receive=True, send=False)
        return
    os.close(woken)
    try:
        run(lambda loop: Claimer(db, loop), args, receive=False, wake=wake)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGTERM)
        os.waitpid(child, 0)


def run(store_of: Callable[[asyncio.AbstractEventLoop], Writer], args: argparse.Namespace,
        receive: bool, send: bool = True, wake: int | None = None) -> None:
    """One process of the floor: receiving, sending, or both; exits 1 with the reason."""
    import uvloop

    async def serve() -> str:
        loop = asyncio.get_running_loop()
        stop: asyncio.Future[str] = loop.create_future()
        store = store_of(loop)
        relay = Relay(loop, store, args.sink_port, args.hops, args.per_hop, stop, forward=send,
                      open_max=args.open_max, banner_s=args.banner_timeout)
        store.failed = relay.fail
        loop.add_signal_handler(signal.SIGTERM, relay.fail, "")
        server = None
        if receive:
            host, port = args.listen.rsplit(":", 1)
            try:
                server = await loop.create_server(lambda: Server(relay), host, int(port),
                                                  reuse_address=True, backlog=1024,
                                                  family=socket.AF_INET)
            except OSError as exc:
                store.close()
                return f"cannot listen on {args.listen}: {exc.strerror or exc}"
            print(f"serving SMTP on {args.listen}", flush=True)
        if wake is not None:
            assert isinstance(store, Claimer)
            Claims(relay, store, wake)
        why = await stop
        if server is not None:
            server.close()
        store.close()
        return why

    why = uvloop.run(serve())
    if why:
        sys.exit(f"relay_floor: {why}")


def _die_with_parent() -> None:
    """SIGTERM this process when its parent dies, however (Linux prctl PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGTERM, 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() == 1:  # the parent died before the prctl
        os._exit(1)


if __name__ == "__main__":
    main()
