"""What the delivery agent decides before MAIL from the EHLO reply and the
headers of the content: may this message go to a host without SMTPUTF8?"""

from __future__ import annotations

import pytest

from sluice.delivery.agent import smtputf8_refusal
from sluice.delivery.client import Envelope
from sluice.delivery.router import Host
from sluice.mime import utf8_headers

pytestmark = pytest.mark.unit

HOST = Host("mx.dest.test", "192.0.2.25", 25)
ASCII = b"From: a@src.test\r\nSubject: hello\r\n\r\nbody\r\n"
UTF8_HEADER = "From: a@src.test\r\nSubject: Grüße\r\n\r\nbody\r\n".encode()
UTF8_BODY = "From: a@src.test\r\nSubject: hello\r\n\r\nGrüße\r\n".encode()
LATIN1_HEADER = b"Subject: caf\xe9\r\n\r\nbody\r\n"


def refusal(head: bytes, *, smtputf8: bool, offered: bool = False,
            sender: str = "a@src.test", rcpt: str = "b@dest.test") -> tuple[int, str] | None:
    found = smtputf8_refusal(Envelope(sender, (rcpt,), len(head), smtputf8),
                             lambda: utf8_headers([head]), offered, HOST)
    return None if found is None else (found.reply.code, found.reply.enhanced)


UTF8_ATTACHMENT = (
    'Subject: hello\r\nContent-Type: multipart/mixed; boundary="b"\r\n\r\n'
    '--b\r\nContent-Type: text/plain\r\n\r\nhi\r\n'
    '--b\r\nContent-Type: text/plain; name="Grüße.txt"\r\n\r\nhi\r\n--b--\r\n').encode()


@pytest.mark.parametrize(("head", "smtputf8", "want"), [
    # Received with SMTPUTF8: refused only when the header block uses UTF-8.
    (UTF8_HEADER, True, (550, "5.6.9")),
    (ASCII, True, None),
    (UTF8_BODY, True, None),  # 8BITMIME carries a UTF-8 body
    (LATIN1_HEADER, True, None),  # 8-bit, but not UTF-8
    (UTF8_ATTACHMENT, True, (550, "5.6.9")),  # a MIME part's header counts too
    # Received without it: goes as it is, whatever the header block holds.
    (UTF8_HEADER, False, None),
    (ASCII, False, None),
], ids=["flagged utf-8 header", "flagged ascii", "flagged utf-8 body", "flagged latin-1",
        "flagged utf-8 part header", "unflagged utf-8 header", "unflagged ascii"])
def test_a_host_without_smtputf8(head: bytes, smtputf8: bool, want: tuple[int, str] | None
                                 ) -> None:
    assert refusal(head, smtputf8=smtputf8) == want


@pytest.mark.parametrize("smtputf8", [True, False])
def test_non_ascii_addresses_never_go_to_a_host_without_smtputf8(smtputf8: bool) -> None:
    assert refusal(ASCII, smtputf8=smtputf8, rcpt="jörg@dest.test") == (553, "5.6.7")
    assert refusal(ASCII, smtputf8=smtputf8, sender="jörg@src.test") == (553, "5.6.7")


@pytest.mark.parametrize("head", [ASCII, UTF8_HEADER])
def test_a_host_with_smtputf8_takes_everything(head: bytes) -> None:
    assert refusal(head, smtputf8=True, offered=True, rcpt="jörg@dest.test") is None


@pytest.mark.parametrize(("smtputf8", "offered", "rcpt"), [
    (False, False, "b@dest.test"), (True, True, "b@dest.test"), (True, False, "jörg@dest.test")])
def test_the_headers_are_looked_at_only_when_they_decide(smtputf8: bool, offered: bool,
                                                         rcpt: str) -> None:
    # Looking at them may mean reading the whole message once more.
    def asked() -> bool:
        raise AssertionError("utf8_headers() called")
    smtputf8_refusal(Envelope("a@src.test", (rcpt,), 0, smtputf8), asked, offered, HOST)


def test_the_refusal_names_the_host() -> None:
    found = smtputf8_refusal(Envelope("a@src.test", ("b@dest.test",), 0, True),
                             lambda: True, False, HOST)
    assert found is not None and str(HOST) in found.reply.text
    assert "SMTPUTF8 is required" in found.reply.text
