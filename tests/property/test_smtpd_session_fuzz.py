"""Any sequence of commands, pipelined and cut anywhere, gets one reply per command.

The session runs on a real event loop with an in-memory transport (no
sockets) and a queue that makes every message durable at once.  Hypothesis
draws command sequences in any order -- out of sequence, malformed,
unknown, overlong, undecodable -- sends them as one pipelined stream cut
into random pieces, and checks: the session never logs an error of its own,
every reply line is well formed, and every command (the DATA text counted
as part of its DATA) got exactly one final reply, until QUIT or a close.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.model import Accepted, Submission
from sluice.queue import Queue
from sluice.smtpd.credentials import Credentials
from sluice.smtpd.policy import ReceivePolicy
from sluice.smtpd.session import SmtpSession
from sluice.smtpd.settings import Registry, Settings

pytestmark = pytest.mark.property

COMMANDS = [
    b"EHLO client.test", b"HELO client.test", b"EHLO", b"MAIL FROM:<a@x.test>",
    b"MAIL FROM:<a@x.test> SIZE=100 BODY=8BITMIME", b"MAIL FROM:<>", b"MAIL FROM:<bad",
    b"MAIL FROM:<a@x.test> FOO=1", b"MAIL TO:<a@x.test>", b"RCPT TO:<b@y.test>",
    b"RCPT TO:<c@y.test>", b"RCPT TO:<no domain>", b"RCPT TO:<b@y.test> NOTIFY=NEVER",
    "RCPT TO:<jürgen@y.test>".encode(), b"RCPT TO:<\xff@y.test>", b"RCPT", b"DATA",
    b"DATA now", b"RSET", b"RSET x", b"NOOP", b"NOOP x", b"VRFY <a@x.test>", b"VRFY",
    b"HELP", b"STARTTLS", b"AUTH PLAIN AGFAYg==", b"AUTH LOGIN", b"AUTH", b"FROB",
    b"", b".", b"\xc3\xa9", b"NOOP " + b"x" * 600, b"X" * 70000, b"QUIT",
]
BODY = b"Subject: fuzz\r\n\r\n..stuffed\r\nbody\r\n.\r\n"
REPLY_LINE = re.compile(rb"^[2-5]\d\d[ -]")


class MemoryTransport(asyncio.Transport):
    """A transport whose writes land in a bytearray; close() reports the loss."""

    def __init__(self, loop: asyncio.AbstractEventLoop, protocol: asyncio.Protocol) -> None:
        super().__init__()
        self.loop = loop
        self.protocol = protocol
        self.out = bytearray()
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.closing:
            self.out += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self.loop.call_soon(self.protocol.connection_lost, None)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class InstantQueue:
    """Stands in for the Queue: every submission is durable at once."""

    node = "fuzz"
    accounting = None

    def __init__(self) -> None:
        self.submitted: list[Submission] = []

    def clock(self) -> float:
        return 1_800_000_000.0

    def submit_future(self, submission: Submission, content: object
                      ) -> concurrent.futures.Future[Accepted]:
        self.submitted.append(submission)
        fut: concurrent.futures.Future[Accepted] = concurrent.futures.Future()
        fut.set_result(Accepted(spid=submission.spid or "S", qids=("S-0",), size=1))
        return fut


def check_replies(lines: list[bytes], replies: list[bytes]) -> None:
    """Walk the lines sent and the final replies together: one reply per command,
    a 354 followed by the text up to its dot and one more reply, nothing after a close."""
    pending = iter(replies)
    sent = iter(lines)
    for line in sent:
        reply = next(pending, None)
        assert reply is not None, f"no reply to {line[:40]!r}"
        if reply.startswith(b"354"):
            for text in sent:
                if text == b".":
                    break
            reply = next(pending, None)
            assert reply is not None, "no reply after the end of DATA"
        if reply[:3] in (b"221", b"421", b"502"):
            break  # the session ended
    assert next(pending, None) is None, "more replies than commands"


def run_session(stream: bytes, cuts: list[int]) -> tuple[list[bytes], InstantQueue]:
    loop = asyncio.new_event_loop()
    fake = InstantQueue()
    config = Settings(hostname="mx.fuzz.test", queue=cast(Queue, fake),
                      policy=ReceivePolicy(max_message_size=10_000),
                      credentials=Credentials({"u": "p"}, allow_plaintext=True), timeout_s=30)
    registry = Registry()
    session = SmtpSession(config, registry, loop)
    transport = MemoryTransport(loop, session)

    async def scenario() -> None:
        session.connection_made(transport)
        start = 0
        for cut in [*sorted(cuts), len(stream)]:
            if cut > start:
                session.data_received(stream[start:cut])
                start = cut
                await asyncio.sleep(0)
        session.eof_received()
        await registry.wait_tasks(10)
        assert not registry.tasks, "the session's task did not end"

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
    lines = bytes(transport.out).split(b"\r\n")
    assert lines[-1] == b""
    return lines[:-1], fake


def final_replies(lines: list[bytes]) -> list[bytes]:
    return [line for line in lines if line[3:4] != b"-"]


@settings(max_examples=150, deadline=None)
@given(picks=st.lists(st.sampled_from(COMMANDS), max_size=30),
       cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=8))
def test_every_command_gets_one_reply_and_the_session_never_fails(
        picks: list[bytes], cuts: list[int]) -> None:
    commands = []
    stream = bytearray()
    for command in picks:
        commands.append(command)
        stream += command + b"\r\n"
        if command == b"DATA":
            stream += BODY  # read as text if DATA was accepted, else as commands
    logger = logging.getLogger("sluice.smtpd")
    errors: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                errors.append(record)

    catch = Catch()
    logger.addHandler(catch)
    try:
        lines, _queue = run_session(bytes(stream), cuts)
    finally:
        logger.removeHandler(catch)
    assert errors == []
    assert lines[0] == b"220 mx.fuzz.test ESMTP Sluice"
    for line in lines:
        assert REPLY_LINE.match(line), line
    sent = bytes(stream).split(b"\r\n")[:-1]
    check_replies(sent, final_replies(lines[1:]))
