"""One round trip through a real Postfix: client -> Sluice -> Postfix -> a mailbox."""

from __future__ import annotations

import smtplib
from pathlib import Path

import pytest

from tests.integration.serving import serving, wait_until
from tests.postfix_run import postfix_instance, postfix_missing

pytestmark = pytest.mark.integration


@pytest.mark.skipif(postfix_missing() is not None, reason=str(postfix_missing()))
def test_sluice_hands_mail_to_postfix_which_stores_it(tmp_path: Path) -> None:
    body = "line one\r\n.a leading dot\r\nGrüße, 8-bit\r\n"
    message = (f"From: alice@sender.example\r\nTo: bob@pf.test\r\nSubject: round trip\r\n"
               f"Message-ID: <rt1@sender.example>\r\n\r\n{body}").encode()
    with postfix_instance(mailbox_domain="pf.test") as pf, \
            serving(tmp_path, delivery={
                "transport": {"pf.test": f"smtp:[127.0.0.1]:{pf.smtpd_port}"}}) as srv:
        with smtplib.SMTP("127.0.0.1", srv.port, local_hostname="client.test") as c:
            c.sendmail("alice@sender.example", ["bob@pf.test"], message,
                       mail_options=["BODY=8BITMIME"])
        assert wait_until(lambda: pf.mailbox.exists()
                          and b"Message-ID: <rt1@sender.example>" in pf.mailbox.read_bytes(), 60)
        assert wait_until(lambda: srv.recipients_left() == 0, 30)
        stored = pf.mailbox.read_bytes()
        log = pf.maillog.read_text()
    # Postfix received it from Sluice (its Received header names our HELO) ...
    assert b"from mx.sluice.test" in stored
    # ... on top of the Received header Sluice added for the client.
    assert b"from client.test ([127.0.0.1])" in stored
    assert "Grüße, 8-bit".encode() in stored
    assert b".a leading dot" in stored
    delivered = [line for line in log.splitlines() if "postfix/virtual" in line]
    assert any("to=<bob@pf.test>" in line and "status=sent (delivered to mailbox)" in line
               for line in delivered)
