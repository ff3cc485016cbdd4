"""The receiving side seen from outside: /metrics, the log lines fail2ban reads, the accounting.

A real `sluice serve` (receiving in its own process, the API in the main
one) with STARTTLS and AUTH, and real clients on loopback: swaks failing
AUTH, smtplib sending over TLS with AUTH, a client that offers only TLS
1.0, a client that aborts in the middle of the handshake and an outsider
refused relaying.  The counters reach /metrics through the accounting log
(the ``session`` line every connection ends with).
"""

from __future__ import annotations

import json
import re
import smtplib
import socket
import ssl
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.integration.serving import wait_until
from tests.integration.test_api_support import ApiServer, api_server
from tests.integration.test_metrics import scrape, total
from tests.integration.test_smtpd import certificate, no_verify, swaks  # noqa: F401
from tests.unit.test_smtpd_credentials import cheap

pytestmark = pytest.mark.integration

OUTSIDER = "127.0.0.2"
FAIL2BAN_AUTH = re.compile(r"sluice\.smtpd: (?P<host>[0-9.]+): AUTH \S+ failed for")
FAIL2BAN_TLS = re.compile(r"sluice\.smtpd: (?P<host>[0-9.]+): TLS handshake failed: ")

COUNTERS = ("sluice_smtpd_connections_total", "sluice_smtpd_auth_failures_total",
            "sluice_smtpd_tls_sessions_total", "sluice_smtpd_tls_failures_total",
            "sluice_smtpd_messages_accepted_total", "sluice_smtpd_message_bytes_accepted_total")


def _sections(cert: str, key: str) -> dict[str, Any]:
    return {
        "smtpd": {"mynetworks": ["127.0.0.1/32"],
                  "tls": {"cert": cert, "key": key},
                  "auth": {"users": {"alice": cheap("ARGON2ID", "s3cret")}}},
        # serve runs with --log-level warning in tests: bring the receiving lines back.
        "logging": {"levels": {"sluice.smtpd": "info"}},
    }


def _old_protocol_client(port: int) -> None:
    """STARTTLS, then a handshake offering TLS 1.0 only (the server wants 1.2 or later)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version = ssl.TLSVersion.TLSv1
        ctx.maximum_version = ssl.TLSVersion.TLSv1
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    with smtplib.SMTP("127.0.0.1", port, local_hostname="old.test",
                      source_address=(OUTSIDER, 0), timeout=10) as c:
        c.ehlo()
        with pytest.raises((ssl.SSLError, ConnectionError, smtplib.SMTPServerDisconnected)):
            c.starttls(context=ctx)


def _aborting_client(port: int) -> None:
    """STARTTLS, then the first bytes of a ClientHello, then a hang-up."""
    with socket.create_connection(("127.0.0.1", port), timeout=10,
                                  source_address=(OUTSIDER, 0)) as sock:
        f = sock.makefile("rb")
        assert f.readline().startswith(b"220")
        sock.sendall(b"EHLO abort.test\r\n")
        while not f.readline().startswith(b"250 "):
            pass
        sock.sendall(b"STARTTLS\r\n")
        assert f.readline().startswith(b"220")
        sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a ClientHello, cut
        f.close()


def _accounting(srv: ApiServer) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted((srv.serving.dir / "log").glob("*.jsonl"))
            for line in path.read_text().splitlines()]


def test_receiving_counters_log_lines_and_session_context(
        tmp_path: Path, certificate: tuple[str, str]) -> None:  # noqa: F811
    cert, key = certificate
    with api_server(tmp_path, **_sections(cert, key)) as srv:
        port = srv.serving.port
        # Present at zero before any connection, so rate() works from the start.
        m = scrape(srv)
        for name in COUNTERS:
            assert name in m and total(m, name) == 0, name
        assert [v for lab, v in m["sluice_smtpd_commands_refused_total"]
                if lab["code"] == "535"] == [0.0]

        # 1. swaks: STARTTLS, then AUTH PLAIN with a wrong password.
        out = swaks(port, "--local-interface", OUTSIDER, "--tls", "--auth", "PLAIN",
                    "--auth-user", "alice", "--auth-password", "wrong",
                    "--from", "alice@outside.test", "--to", "far@elsewhere.test")
        assert out.returncode != 0 and "535 5.7.8" in out.stdout, out.stdout
        # 2. smtplib: STARTTLS, AUTH, one message relayed.
        with smtplib.SMTP("127.0.0.1", port, local_hostname="good.test",
                          source_address=(OUTSIDER, 0), timeout=10) as c:
            c.starttls(context=no_verify())
            c.login("alice", "s3cret")
            c.sendmail("alice@outside.test", ["far@elsewhere.test"],
                       b"Subject: over TLS\r\n\r\nbody\r\n")
        # 3. and 4. two handshakes that fail.
        _old_protocol_client(port)
        _aborting_client(port)
        # 5. an outsider without AUTH: relaying refused (554).
        with smtplib.SMTP("127.0.0.1", port, local_hostname="outsider.test",
                          source_address=(OUTSIDER, 0), timeout=10) as c, \
                pytest.raises(smtplib.SMTPRecipientsRefused):
            c.sendmail("x@outside.test", ["victim@elsewhere.example"], b"Subject: x\r\n\r\n")

        assert wait_until(
            lambda: total(scrape(srv), "sluice_smtpd_connections_total") == 5, 20, 0.3)
        m = scrape(srv)
        output = list(srv.serving.output)
        acct = _accounting(srv)

    assert total(m, "sluice_smtpd_auth_failures_total") == 1
    assert total(m, "sluice_smtpd_tls_sessions_total") == 2  # swaks and smtplib
    assert total(m, "sluice_smtpd_tls_failures_total") == 2
    refused = "sluice_smtpd_commands_refused_total"
    assert total(m, refused, code="535") == 1
    assert total(m, refused, code="554") == 1
    assert total(m, "sluice_smtpd_messages_accepted_total") == 1
    assert total(m, "sluice_smtpd_message_bytes_accepted_total") > 20
    assert total(m, "sluice_messages_accepted_total") == 1

    # One line per failure, naming the client's address first (fail2ban's <HOST>).
    auth = [line for line in output if FAIL2BAN_AUTH.search(line)]
    tls = [line for line in output if FAIL2BAN_TLS.search(line)]
    assert len(auth) == 1 and FAIL2BAN_AUTH.search(auth[0])["host"] == OUTSIDER, output
    assert len(tls) == 2, output
    assert all(FAIL2BAN_TLS.search(line)["host"] == OUTSIDER for line in tls)
    assert not any("Traceback" in line for line in output), output

    # The accounting: the received line carries the session, every connection its line.
    received = [e for e in acct if e["event"] == "received"]
    assert len(received) == 1
    r = received[0]
    assert (r["client_ip"], r["helo"], r["auth_user"]) == (OUTSIDER, "good.test", "alice")
    assert r["tls_protocol"] in ("TLSv1.2", "TLSv1.3") and r["tls_cipher"]
    sessions = [e for e in acct if e["event"] == "session"]
    assert len(sessions) == 5 and {s["client_ip"] for s in sessions} == {OUTSIDER}
    assert sum(s["auth_failures"] for s in sessions) == 1
    failed = sorted((s["helo"], s["tls_failure"]) for s in sessions if s["tls_failure"])
    assert [helo for helo, _ in failed] == ["abort.test", "old.test"], failed
    assert "UNSUPPORTED_PROTOCOL" in failed[1][1], failed  # the old protocol, named
    assert failed[0][1].endswith("closed during the handshake"), failed
    assert all(s["qid"] is None and s["duration_s"] is not None for s in sessions)
