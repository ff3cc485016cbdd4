"""sluice.smtpd against real clients on loopback: smtplib, swaks, smtp-source and raw sockets.

Every test runs a real Receiver (its own event loop thread) over a real
SQLite queue in a temporary directory, and checks what was queued.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import smtplib
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop

from sluice.config import ConfigError
from sluice.model import QueueEntry, QueueState, Selector
from sluice.queue import Queue
from sluice.smtpd import Receiver, hash_password
from sluice.suppression import SuppressionEntry, write_suppression_list
from tests.conftest import SLUICE, make_config, subprocess_env
from tests.integration.serving import wait_until
from tests.unit.test_smtpd_credentials import cheap

pytestmark = pytest.mark.integration

SWAKS = shutil.which("swaks") or "/usr/bin/swaks"
SMTP_SOURCE = shutil.which("smtp-source") or "/usr/sbin/smtp-source"
HOST = "127.0.0.1"
OUTSIDER = "127.0.0.2"  # a loopback address outside mynetworks 127.0.0.1/32


class Running:
    """A Receiver on its own event loop thread, with its queue."""

    def __init__(self, tmp: Path, sections: dict[str, dict[str, Any]],
                 **receiver_kw: Any) -> None:
        smtpd = {"listen": [f"{HOST}:0"], "mynetworks": ["127.0.0.1/32"],
                 **sections.pop("smtpd", {})}
        self.config = make_config(tmp, smtpd=smtpd, **sections)
        self.queue = Queue.open(self.config)
        self.loop = uvloop.new_event_loop()  # as the receiving processes run
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.receiver: Receiver = self.call(self._start(receiver_kw))
        self.port = self.receiver.addresses[0][1]
        self._stopped = False

    async def _start(self, kw: dict[str, Any]) -> Receiver:
        receiver = Receiver.from_config(self.config, self.queue, **kw)
        await receiver.start()
        return receiver

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace_s: float | None = None) -> None:
        if not self._stopped:
            self._stopped = True
            self.call(self.receiver.stop(grace_s))

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.queue.close()

    def entries(self) -> list[QueueEntry]:
        return list(self.queue.store.entries(Selector()))

    def content(self, spid: str) -> bytes:
        with self.queue.store.open_content(spid) as f:
            return f.read()

    def messages(self) -> dict[str, list[QueueEntry]]:
        out: dict[str, list[QueueEntry]] = {}
        for entry in self.entries():
            out.setdefault(entry.spid, []).append(entry)
        return out

    def smtp(self, source: str = HOST, helo: str = "client.test") -> smtplib.SMTP:
        return smtplib.SMTP(HOST, self.port, local_hostname=helo, source_address=(source, 0),
                            timeout=10)

    def accounting(self) -> list[dict[str, Any]]:
        assert self.queue.accounting is not None
        return [json.loads(line) for path in self.queue.accounting.files()
                for line in path.read_text().splitlines()]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Running]]:
    started: list[Running] = []

    def start(**sections: Any) -> Running:
        receiver_kw = sections.pop("receiver_kw", {})
        run = Running(tmp_path / f"r{len(started)}", sections, **receiver_kw)
        started.append(run)
        return run

    yield start
    for run in started:
        run.close()


@pytest.fixture(scope="session")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for mx.sluice.test (openssl ships with postfix)."""
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=mx.sluice.test"],
                   check=True, capture_output=True)
    return str(cert), str(key)


def no_verify() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def swaks(port: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SWAKS, "--server", HOST, "--port", str(port), "--helo",
                           "swaks.test", "--timeout", "10", *args],
                          capture_output=True, encoding="utf-8", errors="replace", timeout=60)


class Raw:
    """A plain socket client: send bytes, read one (possibly multi-line) reply."""

    def __init__(self, port: int, source: str = HOST) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=10,
                                             source_address=(source, 0))
        self.stream = self.sock.makefile("rb")

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, n: int) -> bytes:
        return self.stream.read1(n)

    def reply(self) -> str:
        lines = []
        while True:
            line = self.stream.readline().decode("utf-8", "replace")
            if not line:
                break
            lines.append(line.rstrip("\r\n"))
            if line[3:4] != "-":
                break
        return "\n".join(lines)

    def close(self) -> None:
        self.stream.close()
        self.sock.close()

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- ESMTP extensions -------------------------------------------------------------------


def test_every_extension_is_advertised(serve: Callable[..., Running],
                                       certificate: tuple[str, str]) -> None:
    cert, key = certificate
    run = serve(smtpd={"tls": {"cert": cert, "key": key}, "max_message_size": 123456,
                       "auth": {"users": {"alice": cheap("ARGON2ID", "s3cret")}}})
    with run.smtp() as c:
        code, _ = c.ehlo()
        assert code == 250
        features = c.esmtp_features
        assert {"pipelining", "size", "8bitmime", "smtputf8", "enhancedstatuscodes",
                "starttls"} <= set(features)
        assert features["size"] == "123456"
        assert "auth" not in features  # never offered in clear
        c.starttls(context=no_verify())
        c.ehlo()
        assert c.esmtp_features["auth"].split() == ["PLAIN", "LOGIN"]
        assert "starttls" not in c.esmtp_features
    out = swaks(run.port, "--quit-after", "EHLO").stdout
    for keyword in ("PIPELINING", "SIZE 123456", "8BITMIME", "SMTPUTF8", "ENHANCEDSTATUSCODES",
                    "STARTTLS"):
        assert f"<-  250-{keyword}" in out or f"<-  250 {keyword}" in out, keyword
    assert "220 mx.sluice.test ESMTP Sluice" in out


def test_replies_carry_enhanced_codes(serve: Callable[..., Running]) -> None:
    run = serve()
    sock = Raw(run.port)
    with sock:
        assert sock.reply().startswith("220 mx.sluice.test")
        sock.sendall(b"EHLO raw.test\r\n")
        sock.reply()
        for command, expected in [
            (b"NOOP", "250 2.0.0"),
            (b"RCPT TO:<a@b.test>", "503 5.5.1"),
            (b"DATA", "503 5.5.1"),
            (b"MAIL FROM:<a@b.test> FOO=1", "555 5.5.4"),
            (b"MAIL FROM:<a b@test>", "553 5.1.3"),
            (b"MAIL FROM:<a@b.test> BODY=BINARYMIME", "501 5.5.4"),
            (b"FROB", "500 5.5.2"),
            (b"MAIL FROM:<a@b.test>", "250 2.1.0"),
            (b"MAIL FROM:<a@b.test>", "503 5.5.1"),
            ("RCPT TO:<jürgen@b.test>".encode(), "553 5.6.7"),  # needs SMTPUTF8
            (b"RCPT TO:<x@y.test> NOTIFY=NEVER", "555 5.5.4"),
            (b"DATA", "554 5.5.1"),  # RCPTs were tried, none accepted
            (b"RSET", "250 2.0.0"),
            (b"VRFY <a@b.test>", "252 2.5.0"),
            (b"QUIT", "221 2.0.0"),
        ]:
            sock.sendall(command + b"\r\n")
            assert sock.reply().startswith(expected), command


def test_pipelined_transaction(serve: Callable[..., Running]) -> None:
    told: list[tuple[str, tuple[str, ...]]] = []
    run = serve(receiver_kw={"on_accepted": lambda acc, sub: told.append((acc.spid,
                                                                          sub.recipients))})
    sock = Raw(run.port)
    with sock:
        sock.reply()
        sock.sendall(b"EHLO raw.test\r\nMAIL FROM:<a@x.test>\r\nRCPT TO:<b@y.test>\r\n"
                     b"RCPT TO:<c@y.test>\r\nDATA\r\n")
        assert sock.reply().startswith("250-mx.sluice.test")
        assert [sock.reply()[:9] for _ in range(3)] == ["250 2.1.0", "250 2.1.5", "250 2.1.5"]
        assert sock.reply().startswith("354 ")
        sock.sendall(b"Subject: piped\r\n\r\nbody\r\n.\r\nQUIT\r\n")
        assert sock.reply().startswith("250 2.0.0 Ok: queued as ")
        assert sock.reply().startswith("221 2.0.0")
    (entries,) = run.messages().values()
    assert [e.recipient for e in entries] == ["b@y.test", "c@y.test"]
    assert told == [(entries[0].spid, ("b@y.test", "c@y.test"))]  # the scheduler's cue


# -- size, recipients, lines --------------------------------------------------------------


def test_size_limit_at_mail_from_and_after_data(serve: Callable[..., Running]) -> None:
    run = serve(smtpd={"max_message_size": 2000})
    with run.smtp() as c:
        c.ehlo()
        code, text = c.mail("a@x.test", ["SIZE=5000"])
        assert (code, text[:5]) == (552, b"5.3.4")
        c.rset()
        c.mail("a@x.test")  # no SIZE: found out after DATA
        c.rcpt("b@y.test")
        code, text = c.data(b"Subject: big\r\n\r\n" + b"x" * 3000 + b"\r\n")
        assert (code, text[:5]) == (552, b"5.3.4")
        c.sendmail("a@x.test", ["b@y.test"], b"Subject: small\r\n\r\n" + b"x" * 98 + b"\r\n" * 15,
                   mail_options=["SIZE=1520"])
    (entries,) = run.messages().values()
    assert b"Subject: small" in run.content(entries[0].spid)


def test_recipient_limit(serve: Callable[..., Running]) -> None:
    run = serve(smtpd={"max_recipients": 3})
    with run.smtp() as c:
        c.ehlo()
        c.mail("a@x.test")
        for i in range(3):
            assert c.rcpt(f"r{i}@y.test")[0] == 250
        code, text = c.rcpt("r3@y.test")
        assert (code, text[:5]) == (452, b"4.5.3")
        assert c.data(b"Subject: three\r\n\r\nhi\r\n")[0] == 250
    (entries,) = run.messages().values()
    assert sorted(e.recipient for e in entries) == ["r0@y.test", "r1@y.test", "r2@y.test"]


def test_long_lines_are_accepted_and_kept_byte_exact(serve: Callable[..., Running]) -> None:
    run = serve()
    body = b"<html>" + b"x" * 5000 + b"</html>\r\n" + b"y" * 999 + b"\r\n"
    with run.smtp() as c:
        c.ehlo()
        assert c.sendmail("a@x.test", ["b@y.test"], b"Subject: long\r\n\r\n" + body) == {}
    (spid,) = run.messages()
    assert run.content(spid).endswith(b"\r\n\r\n" + body)


def test_line_longer_than_the_limit_is_refused_when_strict(serve: Callable[..., Running]
                                                           ) -> None:
    run = serve(smtpd={"reject_long_lines": True})
    with run.smtp() as c:
        c.ehlo()
        with pytest.raises(smtplib.SMTPDataError) as err:
            c.sendmail("a@x.test", ["b@y.test"], b"Subject: long\r\n\r\n" + b"x" * 999 + b"\r\n")
        assert err.value.smtp_code == 554
        assert err.value.smtp_error.startswith(b"5.6.0")
        c.rset()
        c.sendmail("a@x.test", ["b@y.test"], b"Subject: ok\r\n\r\n" + b"x" * 998 + b"\r\n")
    assert len(run.messages()) == 1


# -- relay control and AUTH ------------------------------------------------------------------


def test_relay_denied_to_an_outsider(serve: Callable[..., Running]) -> None:
    run = serve(smtpd={"relay_domains": ["inbound.test"]})
    with run.smtp(source=OUTSIDER) as c:
        c.ehlo()
        c.mail("stranger@outside.test")
        code, text = c.rcpt("victim@elsewhere.test")
        assert (code, text[:5]) == (554, b"5.7.1")
        assert b"Relay access denied" in text
        assert c.rcpt("postmaster@inbound.test")[0] == 250  # mail for us is welcome
        assert c.data(b"Subject: inbound\r\n\r\nhello\r\n")[0] == 250
    out = swaks(run.port, "--local-interface", OUTSIDER, "--from", "s@outside.test",
                "--to", "victim@elsewhere.test")
    assert out.returncode != 0
    assert "<** 554 5.7.1 <victim@elsewhere.test>: Relay access denied" in out.stdout
    with run.smtp(source=HOST) as c:  # mynetworks relays anywhere
        c.sendmail("local@inside.test", ["far@elsewhere.test"], b"Subject: out\r\n\r\nhi\r\n")
    assert sorted(e.recipient for e in run.entries()) == ["far@elsewhere.test",
                                                          "postmaster@inbound.test"]


def test_auth_only_over_tls_and_then_relay(serve: Callable[..., Running],
                                           certificate: tuple[str, str]) -> None:
    cert, key = certificate
    run = serve(smtpd={"tls": {"cert": cert, "key": key},
                       "auth": {"users": {"alice": cheap("ARGON2ID", "s3cret"),
                                          "bob": cheap("BLF-CRYPT", "hunter2")}}})
    plain = base64.b64encode(b"\0alice\0s3cret").decode()
    with run.smtp(source=OUTSIDER) as c:
        c.ehlo()
        code, text = c.docmd("AUTH", f"PLAIN {plain}")
        assert (code, text[:6]) == (538, b"5.7.11")  # no credentials in clear
        c.mail("alice@outside.test")
        assert c.rcpt("far@elsewhere.test")[0] == 554
        c.rset()
        c.starttls(context=no_verify())
        c.ehlo()
        code, _ = c.docmd("AUTH", "PLAIN " + base64.b64encode(b"\0alice\0wrong").decode())
        assert code == 535
        assert c.login("alice", "s3cret")[0] == 235
        c.sendmail("alice@outside.test", ["far@elsewhere.test"], b"Subject: authed\r\n\r\nx\r\n")
    out = swaks(run.port, "--local-interface", OUTSIDER, "--tls", "--auth", "LOGIN",
                "--auth-user", "bob", "--auth-password", "hunter2", "--from", "bob@outside.test",
                "--to", "far2@elsewhere.test")
    assert out.returncode == 0, out.stdout
    assert "<~  235 2.7.0 Authentication successful" in out.stdout
    (spid_a, spid_b) = sorted(run.messages(), key=lambda s: run.messages()[s][0].recipient)
    assert b"with ESMTPSA id" in run.content(spid_a)
    assert b"with ESMTPSA id" in run.content(spid_b)


def test_auth_against_every_password_scheme(serve: Callable[..., Running],
                                            certificate: tuple[str, str]) -> None:
    cert, key = certificate
    users = {"argon2id": cheap("ARGON2ID", "pw-argon2id"),
             "argon2i": cheap("ARGON2I", "pw-argon2i"),
             "blf": cheap("BLF-CRYPT", "pw-blf"),
             "sha": cheap("SHA256", "pw-sha"),
             "shahex": cheap("SHA256.HEX", "pw-shahex"),
             "slow": hash_password("pw-slow"),  # the default cost, as `sluice auth hash` makes
             "plain": "{PLAIN}pw-plain"}
    run = serve(smtpd={"tls": {"cert": cert, "key": key},
                       "auth": {"users": users, "allow_plaintext": True}})
    for user in users:
        with run.smtp(source=OUTSIDER) as c:
            c.starttls(context=no_verify())
            c.ehlo()
            with pytest.raises(smtplib.SMTPAuthenticationError) as err:
                c.login(user, f"pw-{user}x")
            assert err.value.smtp_code == 535
            c.login(user, f"pw-{user}")  # PLAIN first (smtplib's choice)
            c.sendmail(f"{user}@outside.test", ["far@elsewhere.test"], b"Subject: a\r\n\r\nx\r\n")
        with run.smtp(source=OUTSIDER) as c:
            c.starttls(context=no_verify())
            c.ehlo()
            c.user, c.password = user, f"pw-{user}"
            assert c.auth("LOGIN", c.auth_login)[0] == 235
    assert len(run.messages()) == len(users)


def test_plain_text_passwords_refused_by_default(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, smtpd={"listen": [f"{HOST}:0"],
                                       "auth": {"users": {"alice": "hunter2"}}})
    queue = Queue.open(cfg)
    try:
        with pytest.raises(ConfigError) as err:
            Receiver.from_config(cfg, queue)
    finally:
        queue.close()
    assert err.value.keypath == "smtpd.auth.users.alice"
    path = tmp_path / "sluice.yaml"
    path.write_text(f"queue: {{path: {tmp_path / 'q'}}}\n"
                    f"smtpd: {{listen: ['{HOST}:0'], auth: {{users: {{alice: hunter2}}}}}}\n")
    proc = subprocess.run([SLUICE, "-c", str(path), "serve"], capture_output=True, text=True,
                          env=subprocess_env(), timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    line = proc.stderr.splitlines()[-1]
    assert line.startswith(f"sluice: config error: {path}: smtpd.auth.users.alice: "
                           "a plain-text password")
    # what `sluice auth hash` prints is accepted
    made = subprocess.run([SLUICE, "auth", "hash", "-s", "blf-crypt"], input="hunter2\n",
                          capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert made.returncode == 0, made.stderr
    entry = made.stdout.strip()
    assert entry.startswith("{BLF-CRYPT}$2b$")
    assert "hunter2" not in entry


def test_repeated_auth_failures_close_the_session(serve: Callable[..., Running],
                                                  certificate: tuple[str, str]) -> None:
    cert, key = certificate
    run = serve(smtpd={"tls": {"cert": cert, "key": key},
                       "auth": {"users": {"a": "{PLAIN}b"}, "allow_plaintext": True}})
    with run.smtp() as c:
        c.starttls(context=no_verify())
        c.ehlo()
        wrong = "PLAIN " + base64.b64encode(b"\0a\0nope").decode()
        assert [c.docmd("AUTH", wrong)[0] for _ in range(2)] == [535, 535]
        code, _text = c.docmd("AUTH", wrong)
        assert code == 535
        assert c.getreply()[0] == 421
        with pytest.raises(smtplib.SMTPServerDisconnected):
            c.noop()


# -- suppression and the end-of-DATA hook --------------------------------------------------


def suppression_file(tmp: Path) -> Path:
    path = tmp / "suppress.jsonl"
    write_suppression_list(path, [SuppressionEntry("bad@x.test", reason="hard",
                                                   category="bad-mailbox"),
                                  SuppressionEntry("@gone.test")])
    return path


def test_suppressed_recipient_is_rejected(serve: Callable[..., Running], tmp_path: Path) -> None:
    run = serve(suppression={"path": str(suppression_file(tmp_path)), "mode": "reject"})
    with run.smtp() as c:
        c.ehlo()
        c.mail("a@sender.test")
        code, text = c.rcpt("bad@x.test")
        assert (code, text[:5]) == (550, b"5.1.1")
        assert b"<bad@x.test>: recipient address suppressed: it bounced permanently" in text
        assert c.rcpt("x@gone.test")[0] == 550
        assert c.rcpt("good@x.test")[0] == 250
        assert c.data(b"Subject: s\r\n\r\nx\r\n")[0] == 250
    assert [e.recipient for e in run.entries()] == ["good@x.test"]
    events = [e for e in run.accounting() if e["event"] == "suppressed"]
    assert sorted(e["recipient"] for e in events) == ["bad@x.test", "x@gone.test"]
    assert all(e["code"] == 550 and e["spid"] is None and e["sender"] == "a@sender.test"
               for e in events)


def test_suppressed_recipient_is_dropped(serve: Callable[..., Running], tmp_path: Path) -> None:
    run = serve(suppression={"path": str(suppression_file(tmp_path)), "mode": "drop"})
    with run.smtp() as c:
        c.ehlo()
        c.sendmail("a@sender.test", ["bad@x.test", "good@x.test"], b"Subject: d\r\n\r\nx\r\n")
        code, _text = c.sendmail("a@sender.test", ["x@gone.test"], b"Subject: d2\r\n\r\nx\r\n"), b""
        assert code == {}  # accepted: dropped silently
    (entries,) = run.messages().values()
    assert [e.recipient for e in entries] == ["good@x.test"]
    events = [e for e in run.accounting() if e["event"] == "suppressed"]
    by_rcpt = {e["recipient"]: e for e in events}
    assert set(by_rcpt) == {"bad@x.test", "x@gone.test"}
    assert by_rcpt["bad@x.test"]["spid"] == entries[0].spid  # dropped from that message
    assert by_rcpt["x@gone.test"]["spid"] is None  # nothing was queued at all
    assert run.receiver.stats().recipients_dropped == 2


HOOK = '''
import asyncio
from sluice.hooks import Accept, Reject
from sluice.model import Reply

seen = []

async def end_of_data(ctx):
    await asyncio.sleep(0)
    headers = ctx.headers()
    seen.append((ctx.client_ip, ctx.helo, ctx.size, ctx.tls, ctx.auth_user))
    subject = headers.get("Subject", "")
    if subject == "reject me":
        return Reject(Reply(550, "5.7.1", "policy says no"))
    if subject == "broken":
        raise RuntimeError("hook bug")
    if subject == "hold":
        return Accept(hold=True, jobid="held")
    if subject == "later":
        return Accept(delay_s=600, jobid="later")
    if subject == "fields":
        return Accept(tenantid=headers["X-Tenant"], jobid="j1", transportid="tx",
                      localip=["127.0.0.9", "127.0.0.10"], priority=1,
                      reply=Reply(250, "2.6.0", "queued by hook"))
    return None
'''


def test_end_of_data_hook_sets_fields_and_rejects(serve: Callable[..., Running],
                                                  tmp_path: Path) -> None:
    (tmp_path / "hook.py").write_text(HOOK)
    run = serve(smtpd={"hook": f"{tmp_path / 'hook.py'}:end_of_data"})
    sent = {}
    with run.smtp() as c:
        c.ehlo()
        for subject in ("fields", "hold", "later", "plain"):
            c.mail("a@x.test")
            c.rcpt(f"{subject}@y.test")
            msg = f"Subject: {subject}\r\nX-Tenant: acme\r\n\r\nbody\r\n".encode()
            sent[subject] = c.data(msg)
        c.mail("a@x.test")
        c.rcpt("r@y.test")
        code, text = c.data(b"Subject: reject me\r\n\r\nx\r\n")
        assert (code, text) == (550, b"5.7.1 policy says no")
        c.mail("a@x.test")
        c.rcpt("r@y.test")
        code, text = c.data(b"Subject: broken\r\n\r\nx\r\n")
        assert (code, text[:5]) == (451, b"4.3.0")  # a failing hook never lets mail through
    assert sent["fields"] == (250, b"2.6.0 queued by hook")
    assert sent["plain"][1].startswith(b"2.0.0 Ok: queued as ")
    by_rcpt = {e.recipient: e for e in run.entries()}
    assert set(by_rcpt) == {"fields@y.test", "hold@y.test", "later@y.test", "plain@y.test"}
    f = by_rcpt["fields@y.test"]
    assert (f.tenantid, f.jobid, f.transportid, f.localip, f.priority) == \
        ("acme", "j1", "tx", ("127.0.0.9", "127.0.0.10"), 1)
    assert f.state is QueueState.INCOMING
    assert by_rcpt["hold@y.test"].state is QueueState.HOLD
    later = by_rcpt["later@y.test"]
    assert later.state is QueueState.DEFERRED
    assert later.next_attempt_at == pytest.approx(later.arrival_at + 600, abs=1)
    assert by_rcpt["plain@y.test"].jobid == ""


# -- what is stored ------------------------------------------------------------------------------


def test_received_header(serve: Callable[..., Running], certificate: tuple[str, str]) -> None:
    cert, key = certificate
    run = serve(smtpd={"tls": {"cert": cert, "key": key}})
    with run.smtp(helo="helo.client.test") as c:
        c.ehlo()
        c.sendmail("a@x.test", ["one@y.test"], b"Subject: 1\r\n\r\nx\r\n")
        c.sendmail("a@x.test", ["one@y.test", "two@y.test"], b"Subject: 2\r\n\r\nx\r\n")
        c.sendmail("a@x.test", ["jürgen@y.test"], b"Subject: 3\r\n\r\nx\r\n",
                   mail_options=["SMTPUTF8"])
        c.starttls(context=no_verify())
        c.ehlo()
        c.sendmail("a@x.test", ["one@y.test"], b"Subject: 4\r\n\r\nx\r\n")
    with run.smtp(helo="old.client.test") as c:
        c.helo()
        c.sendmail("a@x.test", ["one@y.test"], b"Subject: 5\r\n\r\nx\r\n")
    bodies = {}
    spids = {}
    for spid in run.messages():
        body = run.content(spid)
        subject = body.split(b"Subject: ")[1][:1].decode()
        bodies[subject] = body
        spids[subject] = spid
    header, _rest = bodies["1"].split(b"Subject: 1", 1)
    lines = header.split(b"\r\n")
    assert lines[0] == b"Received: from helo.client.test ([127.0.0.1])"
    # The id is the SPID the message is queued under.
    assert lines[1] == f"\tby mx.sluice.test (Sluice) with ESMTP id {spids['1']}".encode()
    for subject, body in bodies.items():
        assert f" id {spids[subject]}".encode() in body.split(b"\r\n\t", 2)[1], subject
    assert lines[2].startswith(b"\tfor <one@y.test>; ")
    date = lines[2].split(b"; ")[1].decode()
    assert abs(time.mktime(time.strptime(date, "%a, %d %b %Y %H:%M:%S +0000"))
               - time.mktime(time.gmtime())) < 120
    assert lines[3] == b""
    assert b"for <" not in bodies["2"].split(b"Subject:")[0]  # two recipients: not named
    assert b"with UTF8SMTP id" in bodies["3"]
    assert "for <jürgen@y.test>".encode() in bodies["3"]
    assert b"with ESMTPS id" in bodies["4"]
    assert b"with SMTP id" in bodies["5"]
    assert b"from old.client.test" in bodies["5"]


def after_received(body: bytes) -> bytes:
    """The message as the client sent it: what follows our (folded) Received header."""
    pos = 0
    while True:
        end = body.index(b"\r\n", pos)
        if body[end + 2 : end + 3] not in (b"\t", b" "):
            return body[end + 2 :]
        pos = end + 2


MESSAGES = [
    # leading dots, a lone dot line, a line of dots, trailing dot, the end marker as text
    b"Subject: dots\r\n\r\n.\r\n..\r\n...\r\n.leading\r\ntrailing.\r\n.\r\n\r\n.x\r\n",
    # long lines up to the limit, and a long header
    b"Subject: long\r\nX-Long: " + b"h" * 900 + b"\r\n\r\n" + b"L" * 998 + b"\r\n" + b"m" * 997
    + b".\r\n",
    # 8-bit body and UTF-8 headers
    "Subject: Grüße aus Köln\r\nFrom: Jürgen <j@x.test>\r\n\r\nCafé \xe9 ünïcödé\r\n"
    .encode() + b"latin1 \xe9\xe8\r\n",
    # bare CR and LF inside lines (swaks would make them CRLF; we keep them)
    b"Subject: bare\r\n\r\nbare\rcr and bare\nlf\r\n",
    # no header block at all, empty lines
    b"\r\n\r\n\r\nbody only\r\n",
]


def test_bodies_are_stored_byte_exact(serve: Callable[..., Running], tmp_path: Path) -> None:
    run = serve(smtpd={"spill_size": 512})  # the long message spills to disk
    with run.smtp() as c:
        c.ehlo()
        for i, msg in enumerate(MESSAGES):
            c.sendmail("a@x.test", [f"smtplib{i}@y.test"], msg, mail_options=["BODY=8BITMIME"])
    for i, msg in enumerate(MESSAGES[:3]):  # swaks stuffs dots, and ends the text with CRLF
        path = tmp_path / f"m{i}.eml"
        path.write_bytes(msg[:-2])
        out = swaks(run.port, "--from", "a@x.test", "--to", f"swaks{i}@y.test",
                    "--data", f"@{path}")
        assert out.returncode == 0, out.stdout
    sock = Raw(run.port)  # and a client that stuffs by itself
    with sock:
        sock.reply()
        sock.sendall(b"EHLO raw.test\r\n")
        sock.reply()
        for i, msg in enumerate(MESSAGES):
            stuffed = b"\r\n".join(b"." + ln if ln.startswith(b".") else ln
                                   for ln in msg[:-2].split(b"\r\n"))
            sock.sendall(b"MAIL FROM:<a@x.test>\r\nRCPT TO:<raw%d@y.test>\r\nDATA\r\n" % i)
            assert [sock.reply()[:3] for _ in range(3)] == ["250", "250", "354"]
            # in small pieces, so that CRLF and the end marker straddle reads
            data = stuffed + b"\r\n.\r\n"
            for start in range(0, len(data), 7):
                sock.sendall(data[start:start + 7])
            assert sock.reply().startswith("250 2.0.0")
    stored = {}
    for spid, entries in run.messages().items():
        body = run.content(spid)
        assert body.startswith(b"Received: ")
        stored[entries[0].recipient] = after_received(body)
    for i, msg in enumerate(MESSAGES):
        assert stored[f"smtplib{i}@y.test"] == msg
        assert stored[f"raw{i}@y.test"] == msg
    for i, msg in enumerate(MESSAGES[:3]):
        # with --data @file swaks sends the file as it is (no headers of its own)
        assert stored[f"swaks{i}@y.test"] == msg
    assert run.receiver.stats().messages_accepted == 2 * len(MESSAGES) + 3


def test_non_ascii_addresses_need_smtputf8(serve: Callable[..., Running]) -> None:
    run = serve()
    with run.smtp() as c:
        c.ehlo()
        c.command_encoding = "utf-8"  # smtplib would refuse to send it otherwise
        code, text = c.mail("jürgen@x.test")
        assert (code, text[:5]) == (553, b"5.6.7")
        c.rset()
        c.sendmail("jürgen@x.test", ["zoë@y.test"], "Subject: ü\r\n\r\nü\r\n".encode(),
                   mail_options=["SMTPUTF8"])
    (entry,) = run.entries()
    assert (entry.sender, entry.recipient) == ("jürgen@x.test", "zoë@y.test")


def test_null_sender_is_accepted(serve: Callable[..., Running]) -> None:
    run = serve()
    with run.smtp() as c:
        c.ehlo()
        c.sendmail("<>", ["b@y.test"], b"Subject: bounce\r\n\r\nx\r\n")
    (entry,) = run.entries()
    assert entry.sender == ""


# -- load, limits, stop ---------------------------------------------------------------------------


def test_many_concurrent_sessions(serve: Callable[..., Running]) -> None:
    run = serve(smtpd={"max_connections_per_client": 100})
    out = subprocess.run([SMTP_SOURCE, "-s", "40", "-m", "1500", "-l", "512", "-f", "s@x.test",
                          "-t", "r@y.test", f"{HOST}:{run.port}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(run.messages()) == 1500
    stats = run.receiver.stats()
    assert stats.messages_accepted == 1500
    assert stats.connections_total == 1500
    assert stats.connections_refused == 0


def test_connection_limits(serve: Callable[..., Running]) -> None:
    run = serve(smtpd={"max_connections_per_client": 2, "max_connections": 3})
    held = []
    for _ in range(2):
        sock = Raw(run.port)
        assert sock.reply().startswith("220 ")
        held.append(sock)
    sock = Raw(run.port)
    with sock:
        assert sock.reply().startswith("421 4.7.0 mx.sluice.test Too many connections from your")
        assert sock.recv(100) == b""  # closed
    sock = Raw(run.port, source=OUTSIDER)  # another client: room for one
    held.append(sock)
    assert sock.reply().startswith("220 ")
    sock = Raw(run.port, source="127.0.0.3")
    with sock:
        assert sock.reply().startswith("421 4.7.0 mx.sluice.test Too many connections, try")
    for s in held:
        s.close()
    assert run.receiver.stats().connections_refused == 2


def test_idle_timeout(serve: Callable[..., Running]) -> None:
    run = serve(smtpd={"timeout": 1})
    sock = Raw(run.port)
    with sock:
        sock.reply()
        t0 = time.monotonic()
        assert sock.reply().startswith("421 4.4.2")
        assert 0.5 < time.monotonic() - t0 < 5
        assert sock.recv(10) == b""


def test_graceful_stop_finishes_messages_in_data(serve: Callable[..., Running]) -> None:
    run = serve()
    busy = Raw(run.port)
    idle = Raw(run.port)
    with busy, idle:
        busy.reply()
        idle.reply()
        busy.sendall(b"EHLO b.test\r\nMAIL FROM:<a@x.test>\r\nRCPT TO:<b@y.test>\r\nDATA\r\n")
        assert [busy.reply()[:3] for _ in range(4)] == ["250", "250", "250", "354"]
        busy.sendall(b"Subject: in flight\r\n\r\nfirst half\r\n")
        stopping = threading.Thread(target=run.stop, args=(10.0,))
        stopping.start()
        assert idle.reply().startswith("421 4.3.2")  # idle: told at once
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the listening socket goes away
            try:
                socket.create_connection((HOST, run.port), timeout=1).close()
            except OSError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("still accepting connections after stop()")
        assert stopping.is_alive()  # waits for the session in DATA
        busy.sendall(b"second half\r\n.\r\n")
        assert busy.reply().startswith("250 2.0.0 Ok: queued as ")
        assert busy.reply().startswith("421 4.3.2")
        assert busy.recv(10) == b""
        stopping.join(10)
        assert not stopping.is_alive()
    (entry,) = run.entries()
    assert run.content(entry.spid).endswith(b"first half\r\nsecond half\r\n")


def test_graceful_stop_gives_up_after_the_grace_period(serve: Callable[..., Running]) -> None:
    run = serve()
    sock = Raw(run.port)
    with sock:
        sock.reply()
        sock.sendall(b"EHLO b.test\r\nMAIL FROM:<a@x.test>\r\nRCPT TO:<b@y.test>\r\nDATA\r\n")
        assert [sock.reply()[:3] for _ in range(4)] == ["250", "250", "250", "354"]
        sock.sendall(b"Subject: never finished\r\n\r\n")
        t0 = time.monotonic()
        run.stop(0.5)
        assert time.monotonic() - t0 < 5
        assert sock.recv(100) == b""
    assert run.entries() == []


def test_a_client_that_leaves_at_once_leaves_no_session(serve: Callable[..., Running]) -> None:
    # A client that connects and closes before the greeting (a port probe)
    # must not hold a session until the idle timeout, nor delay a stop.
    run = serve(smtpd={"max_connections_per_client": 1000})
    # Many at once, so that some close before their session's first step runs.
    probes = [socket.create_connection((HOST, run.port), timeout=5) for _ in range(200)]
    for probe in probes:
        probe.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (run.receiver.sessions
                                           or run.receiver.stats().connections_total < 200):
        time.sleep(0.02)
    assert run.receiver.stats().connections_total == 200
    assert run.receiver.sessions == 0
    t0 = time.monotonic()
    run.stop(20)
    assert time.monotonic() - t0 < 2


def test_stop_reaches_a_session_right_after_starttls(serve: Callable[..., Running],
                                                     certificate: tuple[str, str]) -> None:
    cert, key = certificate
    run = serve(smtpd={"tls": {"cert": cert, "key": key}})
    with run.smtp() as c:
        c.ehlo()
        c.starttls(context=no_verify())  # encrypted, waiting for the new EHLO: idle
        t0 = time.monotonic()
        run.stop(10)
        assert time.monotonic() - t0 < 3
        code, text = c.getreply()
        assert (code, text[:5]) == (421, b"4.3.2")


def test_a_big_message_goes_through_a_temporary_file(serve: Callable[..., Running]) -> None:
    run = serve(smtpd={"max_message_size": 16 << 20})  # spill_size: 1 MiB by default
    line = b"".join(b"%07d " % i for i in range(100)) + b"\r\n"  # 800 octets
    body = b"Subject: big\r\n\r\n" + line * 10000 + b".starts with a dot\r\n"  # 8 MB
    with run.smtp() as c:
        c.ehlo()
        c.sendmail("a@x.test", ["b@y.test"], body)
    (entry,) = run.entries()
    stored = run.content(entry.spid)
    assert after_received(stored) == body
    assert entry.size == len(stored)


def test_garbage_after_starttls_logs_one_line_without_traceback(
        serve: Callable[..., Running], certificate: tuple[str, str],
        caplog: pytest.LogCaptureFixture) -> None:
    cert, key = certificate
    run = serve(smtpd={"tls": {"cert": cert, "key": key}})
    caplog.set_level("DEBUG", logger="sluice")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", run.port), timeout=10) as s:
            s.recv(1024)
            s.sendall(b"EHLO garbage.test\r\nSTARTTLS\r\n")
            time.sleep(0.2)  # let both replies arrive before the garbage
            s.sendall(b"\x16\x03\x01\x00\x05garbage-not-a-handshake\r\n" * 4)
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass
    with run.smtp() as c:  # the server still answers
        assert c.ehlo()[0] == 250
    run.stop()
    records = caplog.records  # ours and aiosmtpd's
    assert not [r for r in records if r.exc_info or "Traceback" in r.getMessage()]
    assert len([r for r in records if r.levelno >= 30]) <= 3


def test_commands_pipelined_behind_starttls_are_thrown_away(
        serve: Callable[..., Running], certificate: tuple[str, str]) -> None:
    # RFC 3207 5 (the STARTTLS command injection of CVE-2011-0411): plaintext
    # a client, or a man in the middle, sends behind STARTTLS must not be
    # executed inside the encrypted session.
    cert, key = certificate
    run = serve(smtpd={"tls": {"cert": cert, "key": key}})
    with socket.create_connection((HOST, run.port), timeout=10) as raw:
        stream = raw.makefile("rb")
        assert stream.readline().startswith(b"220 ")
        raw.sendall(b"EHLO inject.test\r\n")
        while stream.readline()[3:4] == b"-":
            pass
        raw.sendall(b"STARTTLS\r\nMAIL FROM:<injected@x.test>\r\n")
        assert stream.readline().startswith(b"220 ")
        with no_verify().wrap_socket(raw, server_hostname="mx.sluice.test") as tls:
            secure = tls.makefile("rb")
            tls.sendall(b"RCPT TO:<b@y.test>\r\n")
            # had the MAIL been run, this RCPT would be accepted
            assert secure.readline().startswith(b"503 ")
            tls.sendall(b"EHLO inject.test\r\nMAIL FROM:<a@x.test>\r\n")
            while secure.readline()[3:4] == b"-":
                pass
            assert secure.readline().startswith(b"250 2.1.0")
            secure.close()


def test_a_helo_that_is_not_utf8_keeps_its_accounting_lines(
        serve: Callable[..., Running]) -> None:
    # The command's bytes are kept as surrogate escapes; JSON text cannot
    # carry those.  The received and session lines must still be written,
    # with the bytes that are not UTF-8 as U+FFFD.
    run = serve()
    sock = Raw(run.port)
    with sock:
        sock.reply()
        sock.sendall(b"EHLO bad\xff\xfe.client.test\r\n")
        assert sock.reply().startswith("250-mx.sluice.test")
        sock.sendall(b"MAIL FROM:<a@x.test>\r\nRCPT TO:<b@y.test>\r\nDATA\r\n")
        assert [sock.reply()[:3] for _ in range(3)] == ["250", "250", "354"]
        sock.sendall(b"Subject: 8-bit helo\r\n\r\nbody\r\n.\r\nQUIT\r\n")
        assert sock.reply().startswith("250 2.0.0 Ok: queued as ")
        assert sock.reply().startswith("221 2.0.0")
    assert len(run.messages()) == 1

    def lines() -> dict[str, dict[str, Any]]:
        return {e["event"]: e for e in run.accounting()}

    assert wait_until(lambda: {"received", "session"} <= set(lines()), 10), lines()
    for kind in ("received", "session"):
        assert lines()[kind]["helo"] == "bad\ufffd\ufffd.client.test", kind
