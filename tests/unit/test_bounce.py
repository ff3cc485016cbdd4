"""NDRs: RFC 3464 structure, parsed back with the email package."""

from __future__ import annotations

import email
import email.policy
import io

import pytest

from sluice.bounce import FailedRecipient, build_ndr, read_header_block, status_code
from sluice.model import Reply

pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0


def _ndr(failed: list[FailedRecipient], headers: bytes = b"Subject: hi\r\n") -> bytes:
    return build_ndr(
        reporting_mta="mx.sluice.test", from_address="MAILER-DAEMON",
        original_sender="alice@example.org", original_spid="0123456789ABCDEF",
        arrival_at=NOW - 3600, now=NOW, failed=failed, original_headers=headers,
    )


def test_structure_is_a_multipart_report_with_three_parts() -> None:
    raw = _ndr([FailedRecipient("bob@example.net", Reply(550, "5.1.1", "user unknown"),
                                NOW - 10, "mx.example.net")])
    assert b"\r\n" in raw and b"\n" not in raw.replace(b"\r\n", b"")  # CRLF only
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    assert msg.get_content_type() == "multipart/report"
    assert msg.get_param("report-type") == "delivery-status"
    assert msg["To"].addresses[0].addr_spec == "alice@example.org"
    assert "MAILER-DAEMON@mx.sluice.test" in msg["From"]
    assert msg["Auto-Submitted"] == "auto-replied"
    parts = list(msg.iter_parts())
    assert [p.get_content_type() for p in parts] == [
        "text/plain", "message/delivery-status", "text/rfc822-headers"]
    assert "bob@example.net" in parts[0].get_content()

    per_message, per_rcpt = parts[1].get_payload()
    assert per_message["Reporting-MTA"] == "dns; mx.sluice.test"
    assert per_message["Arrival-Date"]
    assert per_rcpt["Final-Recipient"] == "rfc822; bob@example.net"
    assert per_rcpt["Action"] == "failed"
    assert per_rcpt["Status"] == "5.1.1"
    assert per_rcpt["Remote-MTA"] == "dns; mx.example.net"
    assert per_rcpt["Diagnostic-Code"] == "smtp; 550 5.1.1 user unknown"
    assert per_rcpt["Last-Attempt-Date"]
    assert "Subject: hi" in parts[2].get_payload()


def test_one_block_per_failed_recipient_with_its_own_status() -> None:
    raw = _ndr([
        FailedRecipient("a@x.org", Reply(552, "5.2.2", "mailbox full"), NOW),
        FailedRecipient("b@y.org", Reply(451, "4.4.1", "connection refused"), NOW, expired=True),
        FailedRecipient("c@z.org", None, None, expired=True),
    ])
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    blocks = list(msg.iter_parts())[1].get_payload()[1:]
    assert [b["Final-Recipient"] for b in blocks] == [
        "rfc822; a@x.org", "rfc822; b@y.org", "rfc822; c@z.org"]
    assert [b["Status"] for b in blocks] == ["5.2.2", "4.4.1", "4.4.7"]
    assert blocks[2]["Last-Attempt-Date"] is None


@pytest.mark.parametrize(
    ("reply", "expired", "status"),
    [
        (Reply(550, "5.1.1", "x"), False, "5.1.1"),
        (Reply(550, "", "no code"), False, "5.0.0"),
        (Reply(550, "garbage", "x"), False, "5.0.0"),
        (Reply(421, "4.7.0", "try later"), True, "4.7.0"),
        (Reply(421, "", "try later"), True, "4.4.7"),
        (None, True, "4.4.7"),
        (Reply(451, "4.3.0", "x"), False, "5.0.0"),  # operator bounce of a deferred entry
    ],
)
def test_status_codes(reply: Reply | None, expired: bool, status: str) -> None:
    assert status_code(reply, expired) == status


def test_8bit_original_headers_survive() -> None:
    raw = _ndr([FailedRecipient("a@x.org", Reply(550, "5.1.1", "x"), NOW)],
               headers="Subject: Grüße\r\n".encode())
    assert "Subject: Grüße".encode() in raw
    assert b"Content-Transfer-Encoding: 8bit" in raw


def test_a_reply_with_8bit_text_is_kept_for_the_reader_and_ascii_for_the_report() -> None:
    # The client decodes replies as UTF-8, with U+FFFD for bytes that are not.
    reply = Reply(550, "5.1.1", "Benutzer unbekannt \u2013 gr\u00fc\u00dfe \ufffd")
    raw = _ndr([FailedRecipient("a@x.org", reply, NOW)])
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    human, status, _ = msg.iter_parts()
    assert human.get_content_charset() == "utf-8"
    assert "Benutzer unbekannt \u2013 gr\u00fc\u00dfe" in human.get_content()
    assert "Benutzer unbekannt \u2013 gr\u00fc\u00dfe".encode() in raw  # 8bit, not base64
    # RFC 3464: message/delivery-status is US-ASCII.
    block = status.get_payload()[1]
    assert block["Diagnostic-Code"] == "smtp; 550 5.1.1 Benutzer unbekannt ? gr??e ?"


def test_never_an_ndr_to_the_null_sender() -> None:
    with pytest.raises(ValueError, match="null sender"):
        build_ndr(reporting_mta="h", from_address="M", original_sender="",
                  original_spid="0123456789ABCDEF", arrival_at=0, now=1,
                  failed=[FailedRecipient("a@x.org", None)], original_headers=b"")


def test_header_block_stops_at_the_empty_line_and_the_limit() -> None:
    stream = io.BytesIO(b"A: 1\r\nB: 2\r\n\r\nbody\r\n")
    assert read_header_block(stream) == b"A: 1\r\nB: 2\r\n"
    stream = io.BytesIO(b"A: " + b"x" * 1000 + b"\r\n\r\n")
    assert len(read_header_block(stream, limit=100)) == 100
