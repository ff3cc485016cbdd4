"""smtpd.dedupe on a real Receiver and SQLite queue: a resent message is answered
with the first queue id and queued once; anything else is queued as before."""

from __future__ import annotations

import smtplib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.idempotency import HitState
from sluice.model import Submission
from sluice.smtpd.dedupe import Claimed, Duplicate, InFlight, Origin, Resends, settle
from tests.integration.test_smtpd import HOST, Running, no_verify

pytestmark = pytest.mark.integration

SENDER = "app@client.example"
RCPTS = ["ann@dedupe.example", "bob@dedupe.example"]
DEDUPE = {"relay_domains": ["dedupe.example"], "dedupe": True}


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Running]]:
    """Receivers (test_smtpd's Running) started by the test, closed after it."""
    started: list[Running] = []

    def start(**sections: Any) -> Running:
        run = Running(tmp_path / f"r{len(started)}", sections)
        started.append(run)
        return run

    yield start
    for run in started:
        run.close()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=mx.sluice.test"],
                   check=True, capture_output=True)
    return str(cert), str(key)


def message(msg_id: str | None = "<m1@client.example>", body: str = "Hello once.",
            date: str = "Wed, 25 Nov 2026 10:00:00 +0000") -> bytes:
    head = f"From: {SENDER}\r\nTo: ann@dedupe.example\r\nSubject: once\r\nDate: {date}\r\n"
    if msg_id is not None:
        head += f"Message-ID: {msg_id}\r\n"
    return (head + "\r\n" + body + "\r\n").encode()


def send(run: Running, data: bytes, rcpts: list[str] = RCPTS, source: str = HOST,
         login: tuple[str, str] | None = None) -> tuple[int, str]:
    """One transaction; the reply to DATA."""
    with run.smtp(source=source) as c:
        c.ehlo()
        if login is not None:
            c.starttls(context=no_verify())
            c.ehlo()
            c.login(*login)
        assert c.mail(SENDER)[0] == 250
        for r in rcpts:
            assert c.rcpt(r)[0] == 250
        code, text = c.data(data)
        return code, text.decode()


def spid_of(reply: str) -> str:
    assert "queued as " in reply, reply
    return reply.rsplit("queued as ", 1)[1].strip()


def events(run: Running, kind: str) -> list[dict[str, Any]]:
    return [e for e in run.accounting() if e["event"] == kind]


def test_a_resend_is_answered_with_the_first_queue_id_and_queued_once(
        serve: Callable[..., Running]) -> None:
    run = serve(smtpd=DEDUPE)
    code, first = send(run, message())
    assert code == 250
    # Again, recipients in another order, the Date header rebuilt: the same message.
    code, again = send(run, message(date="Wed, 25 Nov 2026 10:05:00 +0000"), RCPTS[::-1])
    assert code == 250
    assert spid_of(again) == spid_of(first)
    assert list(run.messages()) == [spid_of(first)]
    assert len(events(run, "received")) == 2  # one per recipient, once
    dup = events(run, "duplicate")
    assert sorted(e["qid"] for e in dup) == [f"{spid_of(first)}-0", f"{spid_of(first)}-1"]
    assert {e["code"] for e in dup} == {250}


def test_what_differs_is_queued_again(serve: Callable[..., Running]) -> None:
    run = serve(smtpd=DEDUPE)
    spids = {spid_of(send(run, message())[1])}
    spids.add(spid_of(send(run, message(body="Hello twice."))[1]))  # another body
    spids.add(spid_of(send(run, message(msg_id="<m2@client.example>"))[1]))  # another id
    spids.add(spid_of(send(run, message(), RCPTS[:1])[1]))  # other recipients
    spids.add(spid_of(send(run, message(), source="127.0.1.1")[1]))  # another /24
    assert len(spids) == 5 and len(run.messages()) == 5
    # The same /24 is the same client network.
    assert spid_of(send(run, message(), source="127.0.0.2")[1]) in spids
    # Without a Message-ID nothing is deduplicated: both copies are queued.
    a = spid_of(send(run, message(msg_id=None))[1])
    b = spid_of(send(run, message(msg_id=None))[1])
    assert a != b and len(run.messages()) == 7
    assert len(events(run, "duplicate")) == 2


def test_off_by_default_a_resend_is_queued_twice(serve: Callable[..., Running]) -> None:
    run = serve(smtpd={"relay_domains": ["dedupe.example"]})
    a = spid_of(send(run, message())[1])
    b = spid_of(send(run, message())[1])
    assert a != b and len(run.messages()) == 2
    assert not events(run, "duplicate")
    assert not (Path(run.config.queue.path) / "smtpd-dedupe.db").exists()


def test_the_scope_is_the_authenticated_user(serve: Callable[..., Running],
                                             certificate: tuple[str, str]) -> None:
    cert, key = certificate
    run = serve(smtpd={**DEDUPE, "tls": {"cert": cert, "key": key},
                       "auth": {"users": {"alice": "s3cret", "bob": "hunter2"},
                                "allow_plaintext": True}})
    a = spid_of(send(run, message(), login=("alice", "s3cret"))[1])
    b = spid_of(send(run, message(), login=("bob", "hunter2"))[1])
    assert a != b
    # Alice from another network is still Alice.
    assert spid_of(send(run, message(), source="127.0.3.1", login=("alice", "s3cret"))[1]) == a
    assert len(run.messages()) == 2


def test_a_big_message_is_compared_and_queued_intact(serve: Callable[..., Running]) -> None:
    run = serve(smtpd={**DEDUPE, "spill_size": 4096})
    body = "\r\n".join(f"line {i} " + "x" * 60 for i in range(2000))
    data = message(body=body)
    first = spid_of(send(run, data)[1])
    assert spid_of(send(run, data)[1]) == first
    other = spid_of(send(run, message(body=body + "!"))[1])
    assert other != first and len(run.messages()) == 2
    stored = run.content(first)
    assert stored.endswith(data) and stored.startswith(b"Received: ")


def test_a_crash_between_claim_and_submit_lets_the_retry_through(
        serve: Callable[..., Running]) -> None:
    run = serve(smtpd=DEDUPE)
    cfg = run.config
    # A claim made by a process that died before its message was queued...
    resends = Resends.open(cfg)
    data = message()
    sub = Submission(SENDER, tuple(RCPTS), spid="0000000001AAAA")
    mark = resends.mark(sub, [data], Origin(None, HOST), len(data))
    assert mark is not None
    assert resends.claim(mark) == Claimed()
    # ... and another whose message was queued, but not confirmed.
    data2 = message(msg_id="<m2@client.example>")
    queued = run.queue.submit(Submission(SENDER, tuple(RCPTS)), data2)
    sub2 = Submission(SENDER, tuple(RCPTS), spid=queued.spid)
    mark2 = resends.mark(sub2, [data2], Origin(None, HOST), len(data2))
    assert mark2 is not None and resends.claim(mark2) == Claimed()
    resends.close()
    assert settle(cfg, run.queue.store) == (1, 1)
    # The first is queued when the client retries; the second is answered.
    code, reply = send(run, data)
    assert code == 250 and spid_of(reply) != "0000000001AAAA"
    assert spid_of(send(run, data2)[1]) == queued.spid
    assert len(run.messages()) == 2


def test_the_window_expires_a_key(tmp_path: Path, serve: Callable[..., Running]) -> None:
    run = serve(smtpd=DEDUPE)
    now = [1_800_000_000.0]
    resends = Resends.open(run.config)
    resends.clock = lambda: now[0]
    data = message()
    origin = Origin(None, HOST)
    accepted = run.queue.submit(Submission(SENDER, tuple(RCPTS)), data)
    sub = Submission(SENDER, tuple(RCPTS), spid=accepted.spid)
    mark = resends.mark(sub, [data], origin, len(data))
    assert mark is not None and resends.claim(mark) == Claimed()
    resends.confirm(mark, accepted)
    now[0] += 3599  # smtpd.dedupe_window: 1h by default
    again = resends.claim(resends.mark(Submission(SENDER, tuple(RCPTS), spid="0000000002BBBB"),
                                       [data], origin, len(data)) or mark)
    assert isinstance(again, Duplicate) and again.accepted.spid == accepted.spid
    assert again.hit.state is HitState.DONE
    now[0] += 2  # past the window: a new message
    late = resends.mark(Submission(SENDER, tuple(RCPTS), spid="0000000003CCCC"),
                        [data], origin, len(data))
    assert late is not None and resends.claim(late) == Claimed()
    resends.close()


def test_two_resends_at_once_queue_one(serve: Callable[..., Running]) -> None:
    """Two sessions send the same message at the same time: one is queued, the
    other answered with its id or told to try again (451) -- never queued twice."""
    run = serve(smtpd=DEDUPE)
    clients = [smtplib.SMTP(HOST, run.port, timeout=10) for _ in range(2)]
    try:
        for c in clients:
            c.ehlo()
            c.mail(SENDER)
            c.rcpt(RCPTS[0])
        # Both DATA commands in flight before either answer is read.
        for c in clients:
            c.putcmd("data")
        for c in clients:
            assert c.getreply()[0] == 354
            c.send(message() + b".\r\n")
        replies = [c.getreply() for c in clients]
    finally:
        for c in clients:
            c.close()
    codes = sorted(code for code, _ in replies)
    assert codes in ([250, 250], [250, 451]), replies
    assert len(run.messages()) == 1


def test_claims_in_one_batch(serve: Callable[..., Running]) -> None:
    """claim_all: one write for several messages; the same key twice in a batch
    is claimed once, and a key known from before is answered."""
    run = serve(smtpd=DEDUPE)
    resends = Resends.open(run.config)
    data, other = message(), message(msg_id="<m9@client.example>")
    accepted = run.queue.submit(Submission(SENDER, tuple(RCPTS)), data)
    known = resends.mark(Submission(SENDER, tuple(RCPTS), spid=accepted.spid), [data],
                         Origin(None, HOST), len(data))
    assert known is not None and resends.claim(known) == Claimed()
    resends.confirm(known, accepted)

    def mark(text: bytes, spid: str, ip: str = HOST) -> Any:
        return resends.mark(Submission(SENDER, tuple(RCPTS), spid=spid), [text],
                            Origin(None, ip), len(text))

    verdicts = resends.claim_all([
        mark(other, "0000000004AAAA"), mark(other, "0000000004BBBB"),
        mark(other, "0000000004CCCC", ip="127.0.9.1"), mark(data, "0000000004DDDD")])
    assert verdicts[:3] == [Claimed(), InFlight(), Claimed()]
    assert isinstance(verdicts[3], Duplicate) and verdicts[3].accepted.spid == accepted.spid
    resends.close()
