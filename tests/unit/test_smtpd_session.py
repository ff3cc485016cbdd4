"""The SMTP session's pieces that need no network: idle timer, EHLO, envelope, handoff."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from collections.abc import Iterator
from typing import cast

import pytest

from sluice.model import Accepted, Reply, Submission
from sluice.queue import Queue
from sluice.smtpd.credentials import Credentials
from sluice.smtpd.envelope import parse_path
from sluice.smtpd.handoff import Handoff
from sluice.smtpd.policy import ReceivePolicy
from sluice.smtpd.protocol import render
from sluice.smtpd.session import SmtpSession
from sluice.smtpd.settings import Registry, Settings
from sluice.store import StorageError

pytestmark = pytest.mark.unit

@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


#: Nothing here submits mail; the tests that do run a real queue (tests/integration).
NO_QUEUE = cast(Queue, None)


@pytest.fixture
def settings() -> Settings:
    return Settings(hostname="mx.sluice.test", queue=NO_QUEUE, policy=ReceivePolicy(),
                    credentials=Credentials({"u": "{PLAIN}p"}, allow_plaintext=True))


class _Hangups(asyncio.Transport):
    """Records when the session hangs up on a timeout; never closes, so each one counts."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop
        self.closed_at: list[float] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        self.closed_at.append(self.loop.time())


def test_a_command_moves_the_idle_deadline_without_a_new_timer(
        loop: asyncio.AbstractEventLoop, settings: Settings) -> None:
    session = SmtpSession(dataclasses.replace(settings, timeout_s=0.3), Registry(), loop)
    wire = _Hangups(loop)
    session._transport = wire  # what connection_made sets, without its greeting and reader
    fired = wire.closed_at  # the timeout's effect: 421, then the hang-up

    async def scenario() -> None:
        start = loop.time()
        session._reset_timeout()
        armed = session._timeout_handle
        await asyncio.sleep(0.15)
        session._reset_timeout()  # busy again: deadline start + 0.45
        assert session._timeout_handle is armed  # no timer was cancelled or made
        await asyncio.sleep(0.25)  # the first timer fired at start + 0.3, too early
        assert fired == []
        await asyncio.sleep(0.2)
        assert len(fired) == 1 and fired[0] - start >= 0.44
        # A shorter wait than the armed one re-arms at once.
        session._reset_timeout()
        session._reset_timeout(0.05)
        await asyncio.sleep(0.15)
        assert len(fired) == 2

    loop.run_until_complete(scenario())


def test_ehlo_reply_lists_extensions(settings: Settings) -> None:
    lines = settings.ehlo_reply(tls_active=False).decode().split("\r\n")
    assert lines[0] == "250-mx.sluice.test"
    assert lines[-1] == ""
    assert lines[-2].startswith("250 ")
    keywords = [line[4:] for line in lines[1:-1]]
    assert keywords == ["PIPELINING", f"SIZE {settings.policy.max_message_size}", "8BITMIME",
                        "SMTPUTF8", "ENHANCEDSTATUSCODES"]
    tls = settings.ehlo_reply(tls_active=True).decode()
    assert "250 AUTH PLAIN LOGIN\r\n" in tls  # users, and encrypted
    assert "STARTTLS" not in tls


@pytest.mark.parametrize(("arg", "address", "params"), [
    ("<a@b.test>", "a@b.test", ""),
    (" <a@b.test>  SIZE=100 BODY=8BITMIME", "a@b.test", "SIZE=100 BODY=8BITMIME"),
    ("<>", "", ""),
    ("<> SIZE=1", "", "SIZE=1"),
    ("a@b.test SIZE=1", "a@b.test", "SIZE=1"),
    ('<"john doe"@b.test>', '"john doe"@b.test', ""),
    ("<@relay.test,@r2.test:a@b.test>", "a@b.test", ""),
    ("<a@[192.0.2.1]>", "a@[192.0.2.1]", ""),
    ("<jürgen@bücher.test>", "jürgen@bücher.test", ""),
    ("<a@b.test", None, ""),
    ("<a b@c.test>", None, ""),
    ("<a@b@c.test>", None, ""),
    ("<a@>", None, ""),
    ("<@b.test>", None, ""),
    ("<postmaster>", None, ""),
    ("<a\x01@b.test>", None, ""),
    ("<" + "a" * 250 + "@b.test>", None, ""),
])
def test_parse_path(arg: str, address: str | None, params: str) -> None:
    got, rest = parse_path(arg)
    assert got == address
    if address is not None:
        assert rest == params


def test_replies_carry_enhanced_codes_only_for_esmtp() -> None:
    reply = Reply(452, "4.5.3", "Too many recipients")
    assert render(reply, esmtp=True) == b"452 4.5.3 Too many recipients\r\n"
    # HELO: RFC 2034 codes are an ESMTP extension
    assert render(reply, esmtp=False) == b"452 Too many recipients\r\n"
    # but every client understands a 421
    assert render(Reply(421, "4.3.2", "bye"), esmtp=False) == b"421 4.3.2 bye\r\n"


class _FakeQueue:
    """Stands in for Queue.submit_future: hands out futures the test resolves."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.futures: list[concurrent.futures.Future[Accepted]] = []
        self.fail = fail
        self.two = threading.Event()

    def submit_future(self, submission: Submission, content: object
                      ) -> concurrent.futures.Future[Accepted]:
        if self.fail is not None:
            raise self.fail
        fut: concurrent.futures.Future[Accepted] = concurrent.futures.Future()
        self.futures.append(fut)
        if len(self.futures) == 2:
            self.two.set()
        return fut


SUB = Submission(sender="a@x.test", recipients=("b@y.test",))
DONE = Accepted(spid="1A2B3C4D5E6F7A8B", qids=("1A2B3C4D5E6F7A8B-0",), size=10)


def test_handoff_relays_the_durable_result_and_never_cancels_it() -> None:
    fake = _FakeQueue()
    handoff = Handoff(cast(Queue, fake))

    async def scenario() -> None:
        first = handoff.submit(SUB, b"x")
        second = handoff.submit(SUB, b"y")
        assert await asyncio.to_thread(fake.two.wait, 5)
        second.cancel()  # the client of the second message went away
        fake.futures[0].set_result(DONE)
        fake.futures[1].set_result(DONE)  # must not fail: nobody cancelled it
        assert await first == DONE
        assert not fake.futures[1].cancelled()

    asyncio.run(scenario())
    handoff.close()


def test_handoff_relays_store_errors() -> None:
    handoff = Handoff(cast(Queue, _FakeQueue(fail=StorageError("disk full"))))

    async def scenario() -> None:
        with pytest.raises(StorageError, match="disk full"):
            await handoff.submit(SUB, b"x")
        with pytest.raises(StorageError, match="disk full"):
            await handoff.submit(SUB, b"x", big=True)

    asyncio.run(scenario())
    handoff.close()

    async def after_close() -> None:
        with pytest.raises(RuntimeError, match="closed"):
            await handoff.submit(SUB, b"x")

    asyncio.run(after_close())
