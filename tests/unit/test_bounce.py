"""NDRs: RFC 3464 structure, parsed back with the email package."""

from __future__ import annotations

import email
import email.message
import email.policy
import email.utils
import io
import re
from datetime import UTC, datetime

import pytest

from sluice.bounce import FailedRecipient, build_ndr, read_header_block, status_code
from sluice.model import Reply

pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0


def _ndr(failed: list[FailedRecipient], headers: bytes = b"Subject: hi\r\n", *,
         sender: str = "alice@example.org", utf8: bool = False) -> bytes:
    return build_ndr(
        reporting_mta="mx.sluice.test", from_address="MAILER-DAEMON",
        original_sender=sender, original_spid="0123456789ABCDEF",
        arrival_at=NOW - 3600, now=NOW, failed=failed, original_headers=headers, utf8=utf8,
    )


def _unbounded(raw: bytes) -> bytes:
    """The NDR with its MIME boundary (random, from the email package) made constant."""
    match = re.search(rb'boundary="([^"]+)"', raw)
    assert match is not None
    return raw.replace(match.group(1), b"BOUNDARY")


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


def _blocks(raw: bytes) -> list[email.message.Message]:
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    blocks: list[email.message.Message] = list(msg.iter_parts())[1].get_payload()[1:]
    return blocks


def test_what_a_server_said_is_smtp_and_names_the_server_apart() -> None:
    raw = _ndr([FailedRecipient("a@x.org", Reply(550, "5.1.1", "user unknown"), NOW - 600,
                                "mx1.x.org")])
    (block,) = _blocks(raw)
    assert block["Remote-MTA"] == "dns; mx1.x.org"
    # The server's reply as it sent it: our "host X said:" is only for people.
    assert block["Diagnostic-Code"] == "smtp; 550 5.1.1 user unknown"
    human = email.message_from_bytes(raw, policy=email.policy.default).get_payload()[0]
    assert "<a@x.org>: delivery failed permanently (host mx1.x.org said: 550 5.1.1 user " \
           "unknown)" in human.get_content()


@pytest.mark.parametrize("reply", [
    Reply(552, "5.3.4", "message size 9000 exceeds the limit of 1000 bytes of host "
          "mx1.x.org[192.0.2.1]:25"),
    Reply(550, "5.6.9", "SMTPUTF8 is required for the UTF-8 header of this message"),
    Reply(451, "4.4.1", "connect to mx1.x.org[192.0.2.1]:25: Connection refused"),
    Reply(550, "5.0.0", "bounced by the operator"),
])
def test_what_sluice_said_itself_is_x_sluice_without_a_remote_mta(reply: Reply) -> None:
    # RFC 3464 2.3.6: "smtp" is for replies of an SMTP server; no server sent these.
    (block,) = _blocks(_ndr([FailedRecipient("a@x.org", reply, NOW - 600)]))
    assert block["Diagnostic-Code"] == f"X-Sluice; {reply.text}"
    assert block["Remote-MTA"] is None


def test_last_attempt_date_is_the_attempts_not_the_reports() -> None:
    (tried, never) = _blocks(_ndr([
        FailedRecipient("a@x.org", Reply(451, "4.2.0", "busy"), NOW - 7200, "mx1.x.org",
                        expired=True),
        FailedRecipient("b@x.org", Reply(451, "4.4.7", "delivery time expired"), None,
                        expired=True)]))
    assert tried["Last-Attempt-Date"] == email.utils.format_datetime(
        datetime.fromtimestamp(NOW - 7200, UTC))
    assert never["Last-Attempt-Date"] is None


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
    raw = _ndr([FailedRecipient("a@x.org", reply, NOW, "mx.x.org")])
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


# -- RFC 6533: mail received with SMTPUTF8 -------------------------------------------------

GONE = Reply(550, "5.1.1", "user unknown")
UTF8_HEADERS = "From: Jürgen <jürgen@exämple.org>\r\nSubject: Grüße ☃\r\n".encode()


def test_a_utf8_recipient_is_reported_in_a_global_delivery_status_part() -> None:
    long_reply = Reply(550, "5.1.1", "Postfach unbekannt: " + "Grüße " * 20)
    raw = _ndr([FailedRecipient("usér@exämple.net", long_reply, NOW, "mx.example.net"),
                FailedRecipient("bob@example.net", GONE, NOW)], utf8=True)
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    assert msg.get_param("report-type") == "delivery-status"  # RFC 6533 keeps it
    human, status, headers = msg.iter_parts()
    assert status.get_content_type() == "message/global-delivery-status"
    assert headers.get_content_type() == "text/rfc822-headers"  # ASCII: nothing to say
    assert "<usér@exämple.net>" in human.get_content()
    assert b"Content-Type: message/global-delivery-status\r\n" \
           b"Content-Description: Delivery report\r\n" \
           b"Content-Transfer-Encoding: 8bit\r\n\r\n" \
           b"Reporting-MTA: dns; mx.sluice.test\r\n" in raw
    # utf-8-address form (RFC 6533 section 3), raw UTF-8; the ASCII one stays rfc822.
    assert "\r\n\r\nFinal-Recipient: utf-8; usér@exämple.net\r\n".encode() in raw
    assert b"\r\n\r\nFinal-Recipient: rfc822; bob@example.net\r\n" in raw
    # The reply text keeps its UTF-8, folded at spaces, never as encoded words.
    assert b"=?" not in raw
    assert "Diagnostic-Code: smtp; 550 5.1.1 Postfach unbekannt: Grüße Grüße".encode() in raw
    assert all(len(line) <= 78 for line in raw.decode().split("\r\n")
               if line.startswith(("Diagnostic-Code", " Grüße")))


def test_a_utf8_header_block_is_returned_as_message_global_headers() -> None:
    raw = _ndr([FailedRecipient("bob@example.net", GONE, NOW)], UTF8_HEADERS, utf8=True)
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    assert not msg.defects
    _, status, headers = msg.iter_parts()
    assert status.get_content_type() == "message/delivery-status"  # ASCII: unchanged
    assert status.get_payload()[1]["Final-Recipient"] == "rfc822; bob@example.net"
    assert headers.get_content_type() == "message/global-headers"
    assert (b"Content-Type: message/global-headers\r\n"
            b"Content-Description: Undelivered Message Headers\r\n"
            b"Content-Transfer-Encoding: 8bit\r\n\r\n" + UTF8_HEADERS + b"\r\n--") in raw


def test_a_utf8_sender_is_written_raw_in_to_not_as_encoded_words() -> None:
    raw = _ndr([FailedRecipient("bob@example.net", GONE, NOW)], sender="jürgen@exämple.org",
               utf8=True)
    assert "\r\nTo: <jürgen@exämple.org>\r\n".encode() in raw  # RFC 6532
    assert b"=?" not in raw
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    assert str(msg["To"]) == "jürgen@exämple.org"
    assert [p.get_content_type() for p in msg.iter_parts()] == [
        "text/plain", "message/delivery-status", "text/rfc822-headers"]


@pytest.mark.parametrize("headers", [b"Subject: hi\r\n", b"Subject: caf\xe9\r\n"],
                         ids=["ascii", "legacy-8bit"])
def test_received_with_smtputf8_but_nothing_utf8_the_ndr_is_the_usual_one(headers: bytes
                                                                          ) -> None:
    failed = [FailedRecipient("bob@example.net", GONE, NOW, "mx.example.net")]
    assert _unbounded(_ndr(failed, headers, utf8=True)) == _unbounded(_ndr(failed, headers))


def test_not_received_with_smtputf8_a_utf8_header_block_keeps_the_old_form() -> None:
    raw = _ndr([FailedRecipient("bob@example.net", GONE, NOW)], UTF8_HEADERS)
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    assert [p.get_content_type() for p in msg.iter_parts()] == [
        "text/plain", "message/delivery-status", "text/rfc822-headers"]
    assert (b"Content-Type: text/rfc822-headers\r\n"
            b"Content-Description: Undelivered Message Headers\r\n"
            b"Content-Transfer-Encoding: 8bit\r\n\r\n" + UTF8_HEADERS) in raw


def test_a_utf8_recipient_needs_no_flag_it_came_with_smtputf8() -> None:
    # Queued before the flag was kept: the address says it all the same.
    raw = _ndr([FailedRecipient("usér@exämple.net", GONE, NOW)])
    assert "Final-Recipient: utf-8; usér@exämple.net\r\n".encode() in raw
    assert b"Content-Type: message/global-delivery-status\r\n" in raw


def test_a_utf8_header_block_cut_inside_a_character_is_still_utf8() -> None:
    limit = UTF8_HEADERS.index("ü".encode()) + 1  # max_original_headers ends in the ü
    cut = read_header_block(io.BytesIO(UTF8_HEADERS + b"\r\nbody"), limit=limit)
    assert cut.endswith(b"J\xc3")
    raw = _ndr([FailedRecipient("bob@example.net", GONE, NOW)], cut, utf8=True)
    assert b"Content-Type: message/global-headers\r\n" in raw
