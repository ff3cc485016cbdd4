"""Real peers on loopback for the delivery tests (this module holds no tests).

- AuthoritativeDns: a small authoritative DNS server (dnspython's message
  codec over real UDP and TCP sockets on 127.0.0.1), with a query log, and
  names that SERVFAIL or never answer.
- Sink: an aiosmtpd SMTP or LMTP server in the test's event loop with a
  scripted handler: per-recipient replies, a DATA reply, PIPELINING on
  demand, STARTTLS, and a record of every connection and message.
- ScriptServer: a raw server for the misbehaving peers aiosmtpd cannot
  play (421 greeting, stalls, silence).
- self_signed(): a throw-away certificate made with the openssl CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import socketserver
import ssl
import subprocess
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
from aiosmtpd.lmtp import LMTP
from aiosmtpd.smtp import SMTP, Envelope, Session

# -- DNS ---------------------------------------------------------------------------

SOA = "ns.example.test. hostmaster.example.test. 1 3600 600 86400 60"


class AuthoritativeDns:
    """Answers from ``records``: {(name, type): (ttl, [rdata text])}.

    Names with no record of any type are NXDOMAIN; a known name without the
    asked type is NODATA.  Both carry an SOA (minimum 60 s) so that
    resolvers may cache them.  ``servfail`` names answer SERVFAIL; ``silent``
    names get no answer at all.
    """

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], tuple[int, list[str]]] = {}
        self.servfail: set[str] = set()
        self.silent: set[str] = set()
        self.queries: list[tuple[str, str, str]] = []  # (name, type, "udp"/"tcp")
        self._lock = threading.Lock()
        dns_self = self

        class Udp(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                data, sock = self.request
                out = dns_self.answer(data, "udp")
                if out is not None:
                    sock.sendto(out, self.client_address)

        class Tcp(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock = self.request
                while True:
                    head = sock.recv(2)
                    if len(head) < 2:
                        return
                    size = int.from_bytes(head, "big")
                    data = b""
                    while len(data) < size:
                        more = sock.recv(size - len(data))
                        if not more:
                            return
                        data += more
                    out = dns_self.answer(data, "tcp")
                    if out is None:
                        return
                    sock.sendall(len(out).to_bytes(2, "big") + out)

        socketserver.ThreadingUDPServer.allow_reuse_address = True
        # UDP and TCP on one port: the UDP port the kernel picks may be taken
        # for TCP by another process (CI saw EADDRINUSE), so try again then.
        for attempt in range(20):
            self._udp = socketserver.ThreadingUDPServer(("127.0.0.1", 0), Udp)
            self.port = self._udp.server_address[1]
            try:
                self._tcp = socketserver.ThreadingTCPServer(("127.0.0.1", self.port), Tcp)
                break
            except OSError:
                self._udp.server_close()
                if attempt == 19:
                    raise
        self._udp.daemon_threads = self._tcp.daemon_threads = True
        self._threads = [threading.Thread(target=s.serve_forever, daemon=True)
                         for s in (self._udp, self._tcp)]

    def add(self, name: str, rdtype: str, *rdata: str, ttl: int = 300) -> None:
        self.records[(name.lower().rstrip("."), rdtype)] = (ttl, list(rdata))

    def count(self, name: str, rdtype: str) -> int:
        with self._lock:
            return sum(1 for n, t, _ in self.queries if n == name and t == rdtype)

    def answer(self, wire: bytes, via: str) -> bytes | None:
        query = dns.message.from_wire(wire)
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True).lower()
        rdtype = dns.rdatatype.to_text(question.rdtype)
        with self._lock:
            self.queries.append((name, rdtype, via))
        if name in self.silent:
            return None
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        if name in self.servfail:
            response.set_rcode(dns.rcode.SERVFAIL)
            return response.to_wire()
        found = self.records.get((name, rdtype))
        if found is not None:
            ttl, rdatas = found
            response.answer.append(dns.rrset.from_text_list(
                question.name, ttl, dns.rdataclass.IN, question.rdtype, rdatas))
        else:
            if not any(n == name for n, _ in self.records):
                response.set_rcode(dns.rcode.NXDOMAIN)
            response.authority.append(dns.rrset.from_text(
                "example.test.", 60, dns.rdataclass.IN, dns.rdatatype.SOA, SOA))
        max_size = 512 if via == "udp" and query.edns < 0 else max(query.payload, 512)
        try:
            return response.to_wire(max_size=max_size if via == "udp" else 65535)
        except dns.exception.TooBig:
            response.answer.clear()
            response.flags |= dns.flags.TC
            return response.to_wire()

    def start(self) -> AuthoritativeDns:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        for s in (self._udp, self._tcp):
            s.shutdown()
            s.server_close()


# -- SMTP / LMTP sinks ----------------------------------------------------------------


@dataclass
class Received:
    peer: tuple[str, int]
    helo: str
    sender: str
    recipients: tuple[str, ...]
    data: bytes
    mail_options: tuple[str, ...]
    tls: bool


@dataclass
class SinkHandler:
    """aiosmtpd handler: replies scripted per recipient, records everything."""

    rcpt_replies: dict[str, str] = field(default_factory=dict)
    data_reply: str = "250 2.0.0 queued"
    pipelining: bool = False
    lmtp_replies: dict[str, str] = field(default_factory=dict)
    messages: list[Received] = field(default_factory=list)
    connections: list[tuple[str, int]] = field(default_factory=list)
    closed: int = 0

    async def handle_EHLO(self, server: SMTP, session: Session, envelope: Envelope,
                          hostname: str, responses: list[str]) -> list[str]:
        session.host_name = hostname
        if self.pipelining:
            responses.insert(len(responses) - 1, "250-PIPELINING")
        return responses

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, rcpt_options: list[str]) -> str:
        reply = self.rcpt_replies.get(address)
        if reply is not None:
            return reply
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 ok"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        assert isinstance(envelope.original_content, bytes)
        self.messages.append(Received(
            peer=session.peer, helo=session.host_name or "", sender=envelope.mail_from or "",
            recipients=tuple(envelope.rcpt_tos), data=envelope.original_content,
            mail_options=tuple(envelope.mail_options), tls=session.ssl is not None))
        if isinstance(server, LMTP):
            return "\r\n".join(self.lmtp_replies.get(r, "250 2.0.0 delivered to " + r)
                               for r in envelope.rcpt_tos)
        return self.data_reply


class _Counting:
    handler: SinkHandler

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.handler.connections.append(transport.get_extra_info("peername")[:2])
        super().connection_made(transport)  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self.handler.closed += 1
        super().connection_lost(exc)  # type: ignore[misc]


class _SMTP(_Counting, SMTP):
    line_length_limit = 1 << 20  # let the tests send lines far past 998


class _LMTP(_Counting, LMTP):
    line_length_limit = 1 << 20


@dataclass
class Sink:
    handler: SinkHandler
    port: int
    host: str


@contextlib.asynccontextmanager
async def sink(handler: SinkHandler | None = None, *, lmtp: bool = False, host: str = "127.0.0.1",
               tls: ssl.SSLContext | None = None, smtputf8: bool = True,
               data_size_limit: int = 33554432) -> AsyncIterator[Sink]:
    """An aiosmtpd server on ``host``, port chosen by the kernel."""
    handler = handler or SinkHandler()
    cls = _LMTP if lmtp else _SMTP
    loop = asyncio.get_running_loop()

    def factory() -> SMTP:
        proto = cls(handler, hostname="sink.test", ident="sink", enable_SMTPUTF8=smtputf8,
                    tls_context=tls, data_size_limit=data_size_limit, timeout=30)
        proto.handler = handler
        return proto

    server = await loop.create_server(factory, host, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield Sink(handler, port, host)
    finally:
        server.close()
        await server.wait_closed()


# -- raw misbehaving servers ------------------------------------------------------------

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(serve: Serve, *, host: str = "127.0.0.1") -> AsyncIterator[int]:
    """A TCP server running ``serve`` per connection; yields its port."""
    tasks: set[asyncio.Task[None]] = set()

    async def run_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await serve(reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            tasks.discard(task)

    server = await asyncio.start_server(run_one, host, 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for task in list(tasks):  # stalled peers never finish by themselves
            task.cancel()
        await asyncio.sleep(0)


def mini_smtp(*, greeting: bytes | None = b"220 mini.test ESMTP\r\n",
              ehlo: bytes = b"250-mini.test\r\n250 PIPELINING\r\n",
              stall_on: bytes | None = None, stop_reading_after_354: bool = False,
              on_command: Callable[[bytes], bytes | None] | None = None) -> Serve:
    """A small SMTP server that accepts everything, or misbehaves as told:
    no ``greeting`` (None), silence from the first line starting with
    ``stall_on`` (b"MAIL", b"." for the final dot), or no more reading after
    354.  ``on_command`` may answer a command instead (b"" closes)."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if greeting is None:
            await asyncio.sleep(3600)
        writer.write(greeting)
        in_data = False
        while line := await reader.readline():
            if stall_on is not None and line.upper().startswith(stall_on):
                await asyncio.sleep(3600)
            if in_data:
                if line == b".\r\n":
                    in_data = False
                    writer.write(b"250 2.0.0 ok\r\n")
                continue
            if on_command is not None:
                out = on_command(line)
                if out == b"":
                    return
                if out is not None:
                    writer.write(out)
                    continue
            verb = line[:4].upper()
            if verb in (b"EHLO", b"LHLO"):
                writer.write(ehlo)
            elif verb == b"DATA":
                writer.write(b"354 go ahead\r\n")
                if stop_reading_after_354:
                    await asyncio.sleep(3600)
                in_data = True
            elif verb == b"QUIT":
                writer.write(b"221 bye\r\n")
                return
            else:
                writer.write(b"250 ok\r\n")
    return serve


# -- TLS -----------------------------------------------------------------------------


def self_signed(directory: Path) -> tuple[Path, Path]:
    """(cert, key) for CN=sink.test, made with the openssl command."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2",
         "-subj", "/CN=sink.test"],
        check=True, capture_output=True)
    return cert, key


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


@contextlib.contextmanager
def dns_server() -> Iterator[AuthoritativeDns]:
    server = AuthoritativeDns().start()
    try:
        yield server
    finally:
        server.stop()


def run(coro: Awaitable[Any]) -> Any:
    """Run one test scenario in a fresh event loop."""
    return asyncio.run(coro)  # type: ignore[arg-type]
