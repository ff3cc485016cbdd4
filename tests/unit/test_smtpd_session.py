"""The aiosmtpd adapter's pieces that need no network: its lean constructor and envelope parsing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from collections.abc import Iterator
from typing import cast

import pytest
from aiosmtpd.smtp import SMTP

from sluice.model import Accepted, Reply, Submission
from sluice.queue import Queue
from sluice.smtpd.credentials import Credentials
from sluice.smtpd.handoff import Handoff
from sluice.smtpd.policy import ReceivePolicy
from sluice.smtpd.session import (
    Registry,
    Settings,
    SmtpSession,
    _parse_path,
)
from sluice.store import StorageError

pytestmark = pytest.mark.unit

#: Attributes only our session has: its own state, and the command limits,
#: which aiosmtpd keeps in a dict shared by every session of the process.
OURS = {"_settings", "_registry", "_policy", "_ip", "_port", "_client", "_txn", "_auth_user",
        "_auth_failures", "_offered", "_admitted", "_idle", "_closing", "command_size_limits",
        "_deadline", "_timer_at"}


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


def test_lean_constructor_sets_what_aiosmtpd_sets(loop: asyncio.AbstractEventLoop,
                                                  settings: Settings) -> None:
    # SmtpSession skips SMTP.__init__ (its per-connection introspection);
    # if aiosmtpd grows new state, this fails and the constructor must follow.
    base = SMTP(object(), hostname="mx.sluice.test", loop=loop, enable_SMTPUTF8=True)
    ours = SmtpSession(settings, Registry(), loop)
    assert set(vars(ours)) - OURS == set(vars(base))
    assert ours.hostname == "mx.sluice.test"
    assert ours.data_size_limit == settings.policy.max_message_size
    assert ours.enable_SMTPUTF8
    assert ours._auth_require_tls
    assert set(ours._auth_methods) == {"PLAIN", "LOGIN"}
    assert set(ours._smtp_methods) >= {"EHLO", "HELO", "MAIL", "RCPT", "DATA", "RSET", "NOOP",
                                       "QUIT", "STARTTLS", "AUTH", "VRFY", "HELP"}
    # bound to this session, not to another
    assert ours._smtp_methods["MAIL"].__self__ is ours


def test_a_command_moves_the_idle_deadline_without_a_new_timer(
        loop: asyncio.AbstractEventLoop, settings: Settings) -> None:
    session = SmtpSession(dataclasses.replace(settings, timeout_s=0.3), Registry(), loop)
    fired: list[float] = []
    session._timeout_cb = lambda: fired.append(loop.time())  # type: ignore[method-assign]

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


def test_no_users_no_auth_mechanisms(loop: asyncio.AbstractEventLoop) -> None:
    plain = Settings(hostname="mx", queue=NO_QUEUE, policy=ReceivePolicy())
    assert SmtpSession(plain, Registry(), loop)._auth_methods == {}


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
    got, rest = _parse_path(arg)
    assert got == address
    if address is not None:
        assert rest == params


def test_replies_carry_enhanced_codes_only_for_esmtp(loop: asyncio.AbstractEventLoop,
                                                     settings: Settings) -> None:
    session = SmtpSession(settings, Registry(), loop)
    session.session = session._create_session()
    reply = Reply(452, "4.5.3", "Too many recipients")
    session.session.extended_smtp = True
    assert session._render(reply) == b"452 4.5.3 Too many recipients\r\n"
    session.session.extended_smtp = False  # HELO: RFC 2034 codes are an ESMTP extension
    assert session._render(reply) == b"452 Too many recipients\r\n"


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


def test_aiosmtpd_command_logging_is_skipped_when_off_and_still_masks_auth(
        caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import aiosmtpd.smtp

    import sluice.smtpd.session  # noqa: F401  (installs the lazy sanitiser)

    mail_log = logging.getLogger("mail.log")
    calls: list[object] = []
    original = aiosmtpd.smtp.sanitize
    aiosmtpd.smtp.sanitize = lambda text: calls.append(text) or original(text)  # type: ignore[assignment]
    try:
        mail_log.setLevel(logging.WARNING)
        aiosmtpd.smtp.sanitized_log(mail_log.info, "%r >> %r", "peer", b"AUTH PLAIN c2VjcmV0\r\n")
        assert calls == []  # dropped without the regular expression running
        mail_log.setLevel(logging.INFO)
        with caplog.at_level(logging.INFO, logger="mail.log"):
            aiosmtpd.smtp.sanitized_log(mail_log.info, "%r >> %r", "peer",
                                        b"AUTH PLAIN c2VjcmV0\r\n")
        assert len(calls) == 1
        assert "c2VjcmV0" not in caplog.text and "********" in caplog.text
    finally:
        aiosmtpd.smtp.sanitize = original  # type: ignore[assignment]
        mail_log.setLevel(logging.NOTSET)
