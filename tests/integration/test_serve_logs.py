"""`sluice serve` says what happens: one log line per event, and a mail log.

Real traffic over loopback: a programmable sink (accepts, greylists,
rejects), a next hop that refuses connections, a relay attempt from an
outsider.  The lines are read from serve's own stderr and from the mail log
file; pflogsumm (Debian package, installed by scripts/setup) reads the mail
log when it is there.
"""

from __future__ import annotations

import json
import shutil
import smtplib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.sink import Behaviour, Sink
from tests.integration.serving import free_port, serving, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def sink() -> Iterator[tuple[Sink, int]]:
    s = Sink({"grey.example": Behaviour("greylist"), "bad.example": Behaviour("reject")})
    port = s.start_in_thread()
    yield s, port
    s.stop_thread()


def _send(port: int, sender: str, rcpts: list[str], **kw: object) -> None:
    with smtplib.SMTP("127.0.0.1", port, local_hostname="client.test", **kw) as c:  # type: ignore[arg-type]
        c.sendmail(sender, rcpts, b"Subject: hello\r\n\r\nbody\r\n")


def _sections(tmp: Path, sport: int, dead: int, fmt: str) -> dict[str, dict[str, object]]:
    return {
        "delivery": {"transport": {"*": f"smtp:[127.0.0.1]:{sport}",
                                   "dead.example": f"smtp:[127.0.0.1]:{dead}"}},
        "smtpd": {"mynetworks": ["127.0.0.1/32"], "relay_domains": ["local.example"]},
        # serve runs with --log-level warning in tests: the levels by module
        # bring the mail and receiving lines back.
        "logging": {"format": fmt, "maillog": str(tmp / "maillog"),
                    "levels": {"sluice.mail": "info", "sluice.smtpd": "info"}},
    }


def _traffic(srv_port: int) -> None:
    _send(srv_port, "alice@sender.example", ["a@ok.example", "b@grey.example"])
    _send(srv_port, "alice@sender.example", ["c@bad.example"])
    _send(srv_port, "alice@sender.example", ["d@dead.example"])
    with smtplib.SMTP("127.0.0.1", srv_port, local_hostname="outsider.test",
                      source_address=("127.0.0.2", 0)) as c, \
            pytest.raises(smtplib.SMTPRecipientsRefused):
        c.sendmail("x@outsider.test", ["victim@elsewhere.example"], b"Subject: x\r\n\r\n")


def test_serve_logs_each_event_once_in_text(tmp_path: Path, sink: tuple[Sink, int]) -> None:
    s, sport = sink
    dead = free_port()  # nothing listens: connection refused
    with serving(tmp_path, **_sections(tmp_path, sport, dead, "text")) as srv:
        _traffic(srv.port)
        assert wait_until(lambda: s.snapshot().delivered["grey.example"] == 1, 30)
        assert wait_until(lambda: any("deferred" in line and "d@dead.example" in line
                                      for line in srv.output), 30)
        assert wait_until(lambda: any(" ndr " in line for line in srv.output), 30)
    out = srv.output
    assert sum("serving SMTP on" in line for line in out) == 1, out
    assert not any("Traceback" in line for line in out), out

    def lines(*words: str) -> list[str]:
        return [line for line in out if all(w in line for w in words)]

    assert lines("INFO sluice.mail: delivered", "to=<a@ok.example>", "relay=127.0.0.1[127.0.0.1]")
    assert lines("WARNING sluice.mail: deferred", "to=<b@grey.example>", "451")
    assert lines("INFO sluice.mail: delivered", "to=<b@grey.example>")
    assert lines("WARNING sluice.mail: bounced", "to=<c@bad.example>", "550")
    assert lines("INFO sluice.mail: ndr", "to=<c@bad.example>")
    refused = lines("WARNING sluice.mail: deferred", "to=<d@dead.example>")
    assert refused and all(line.count("\n") == 0 for line in refused)
    # the relay denial names the client's address, first (fail2ban's <HOST>)
    assert lines("sluice.smtpd: 127.0.0.2:", "victim@elsewhere.example", "refused")

    maillog = (tmp_path / "maillog").read_text().splitlines()
    sent = [m for m in maillog if "to=<a@ok.example>" in m]
    assert len(sent) == 1 and " mx.sluice.test sluice/smtp[" in sent[0]
    assert ", dsn=2.0.0, status=sent (250 " in sent[0] and ", delays=0/" in sent[0]
    assert any("to=<c@bad.example>" in m and "status=bounced (host 127.0.0.1[127.0.0.1] said: "
               "550 5.1.1" in m for m in maillog)
    assert any("to=<d@dead.example>" in m and ", dsn=4.4.1, status=deferred (" in m
               and "Connection refused" in m for m in maillog)
    assert any("sluice/qmgr[" in m and "from=<alice@sender.example>, size=" in m
               for m in maillog)

    if shutil.which("pflogsumm") is None:
        pytest.skip("pflogsumm is not installed (Debian package pflogsumm, scripts/setup)")
    summary = subprocess.run(["pflogsumm", "--syslog-name=sluice", "--iso-date-time",
                              str(tmp_path / "maillog")], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    counts = {}
    for line in summary.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].isdigit() and parts[1] in (
                "delivered", "deferred", "bounced"):
            counts.setdefault(parts[1], int(parts[0]))
    assert counts.get("delivered") == 3, summary  # a, b, and the NDR to alice
    assert counts.get("bounced") == 1, summary
    assert counts.get("deferred", 0) >= 2, summary


def test_serve_logs_json_one_object_a_line(tmp_path: Path, sink: tuple[Sink, int]) -> None:
    s, sport = sink
    with serving(tmp_path, **_sections(tmp_path, sport, free_port(), "json")) as srv:
        _send(srv.port, "alice@sender.example", ["a@ok.example"])
        assert wait_until(lambda: s.snapshot().delivered["ok.example"] == 1, 30)
        assert wait_until(lambda: any('"delivered' in line for line in srv.output), 30)
    records = [json.loads(line) for line in srv.output if line.startswith("{")]
    assert len(records) == len([line for line in srv.output if line.strip()]), srv.output
    done = [r for r in records if r["logger"] == "sluice.mail"
            and r.get("event", {}).get("event") == "delivered"]
    assert done and done[0]["level"] == "INFO"
    assert done[0]["event"]["recipient"] == "a@ok.example"
    assert sum("serving SMTP on" in r["message"] for r in records) == 1
