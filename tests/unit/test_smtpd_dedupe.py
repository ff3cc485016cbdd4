"""The resend rule's pure parts: scope, key and body digest (sluice.smtpd.dedupe)."""

from __future__ import annotations

import hashlib

import pytest

from sluice.smtpd.dedupe import Origin, body_digest, message_key, scope_of

TEXT = (b"From: a@x.example\r\nMessage-ID:\r\n  <id-1@x.example>\r\nSubject: s\r\n\r\n"
        b"line one\r\n\r\nline three\r\n")


@pytest.mark.parametrize(("origin", "scope"), [
    (Origin("alice", "192.0.2.7"), "user:alice"),
    (Origin(None, "192.0.2.7"), "net:192.0.2.0/24"),
    (Origin(None, "192.0.2.250"), "net:192.0.2.0/24"),
    (Origin(None, "2001:db8:1:2:3:4:5:6"), "net:2001:db8:1:2::/64"),
    (Origin("", "198.51.100.1"), "net:198.51.100.0/24"),
    (Origin(None, "unknown"), "ip:unknown"),
])
def test_the_scope_is_the_user_or_the_client_network(origin: Origin, scope: str) -> None:
    assert scope_of(origin) == scope


def test_the_digest_is_of_the_body_and_ignores_how_it_was_cut() -> None:
    whole = body_digest([TEXT])
    assert whole == ("<id-1@x.example>",
                     hashlib.sha256(b"line one\r\n\r\nline three\r\n").hexdigest())
    for cut in range(1, len(TEXT)):
        assert body_digest([TEXT[:cut], TEXT[cut:]]) == whole, cut
    assert body_digest(TEXT[i:i + 1] for i in range(len(TEXT))) == whole


def test_bare_line_feeds_end_the_header_block_too() -> None:
    bare = TEXT.replace(b"\r\n", b"\n")
    assert body_digest([bare]) == ("<id-1@x.example>",
                                   hashlib.sha256(b"line one\n\nline three\n").hexdigest())
    for cut in range(1, len(bare)):
        assert body_digest([bare[:cut], bare[cut:]]) == body_digest([bare]), cut
    assert body_digest([bare.replace(b"three", b"3")]) != body_digest([bare])
    assert body_digest([b"\nbody\n"]) == ("", hashlib.sha256(b"body\n").hexdigest())


def test_headers_other_than_message_id_do_not_count() -> None:
    other = TEXT.replace(b"Subject: s", b"Subject: s\r\nDate: Thu, 26 Nov 2026 10:00:00 +0000")
    assert body_digest([other]) == body_digest([TEXT])
    assert body_digest([TEXT.replace(b"line three", b"line 3")]) != body_digest([TEXT])


def test_no_message_id_and_no_header_block() -> None:
    assert body_digest([b"Subject: s\r\n\r\nbody\r\n"])[0] == ""
    assert body_digest([b"\r\nbody only\r\n"]) == ("", hashlib.sha256(b"body only\r\n").hexdigest())
    assert body_digest([]) == ("", hashlib.sha256(b"").hexdigest())
    # No empty line: all of it counts, so that different messages stay different.
    only = b"Message-ID: <h>\r\nSubject: one\r\n"
    assert body_digest([only]) == ("<h>", hashlib.sha256(only).hexdigest())
    assert body_digest([only.replace(b"one", b"two")]) != body_digest([only])


def test_the_key_ignores_recipient_order_only() -> None:
    key = message_key("<m>", "s@x", ["a@y", "b@y"], "d")
    assert message_key("<m>", "s@x", ["b@y", "a@y"], "d") == key
    others = [message_key("<n>", "s@x", ["a@y", "b@y"], "d"),
              message_key("<m>", "t@x", ["a@y", "b@y"], "d"),
              message_key("<m>", "s@x", ["a@y"], "d"),
              message_key("<m>", "s@x", ["a@y", "b@y"], "e"),
              message_key("<m>", "s@x", ["a@y\0b@y"], "d")]
    assert key not in others and len(set(others)) == len(others)
