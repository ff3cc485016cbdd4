"""`sluice shaping apply`: advice simulated on the real queue, installed, rolled back.

A real `sluice serve` holds mail for slow.test, routed by the transport map
to 127.0.0.1 on a port where nothing listens (so it stays queued), and for
other.test, routed elsewhere.  Advice for the next hop 127.0.0.1 (an
IP-literal MX group, as `sluice analytics shape` writes it) is applied with
--dry-run (a simulation of slow.test's queue with and without it, nothing
installed), then for real (a policy condition in the running policy, in
the audit history), then rolled back with `sluice policy-audit rollback`.
"""

from __future__ import annotations

import json
import re
import smtplib
import subprocess
from pathlib import Path

import pytest

from tests.conftest import SLUICE, subprocess_env
from tests.integration.serving import free_port, start_serve, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "advice-token-0123456789"

ADVICE = """\
# as sluice analytics shape writes it
rules:
- name: advice-ip-127-0-0-1
  where: {mx: 127.0.0.1}
  reply: {code: 4xx, regex: '^(?!4\\.2\\.)(?:4\\.7\\.\\d{1,3}\\b|.*(?:rate|too many))'}
  trigger: {matches: 1}
  action: condition
  thresholds: {concurrency: 2, rate: 9/60}
  duration: 2h
  note: advised by sluice analytics shape; 12 throttling replies
  test: 421 4.7.0 Try again later, closing connection. (rate limited)
"""


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SLUICE, "-c", str(config), *args], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)


def test_advice_is_simulated_installed_and_rolled_back(tmp_path: Path) -> None:
    closed = free_port()
    api_port = free_port()
    srv = start_serve(
        tmp_path,
        delivery={"transport": {"slow.test": f"smtp:[127.0.0.1]:{closed}",
                                "other.test": f"smtp:[127.0.0.2]:{closed}"}},
        api={"enabled": True, "listen": f"127.0.0.1:{api_port}", "tokens": {"ops": TOKEN}},
        queue={"retry_delays": "1h"})
    try:
        with smtplib.SMTP("127.0.0.1", srv.port, timeout=30) as client:
            for i in range(40):
                client.sendmail("shop@sender.example", [f"r{i}@slow.test"],
                                f"Subject: {i}\r\n\r\nhello\r\n".encode())
            client.sendmail("shop@sender.example", ["x@other.test"], b"Subject: o\r\n\r\nhi\r\n")
        assert wait_until(lambda: srv.recipients_left() == 41, 30)
        advice = tmp_path / "shaping-advice.yaml"
        advice.write_text(ADVICE)

        dry = _cli(srv.config, "shaping", "apply", str(advice), "--dry-run")
        assert dry.returncode == 0, dry.stderr
        row = next(line for line in dry.stdout.splitlines() if line.startswith("slow.test"))
        assert "127.0.0.1" in row and "advice-ip-127-0-0-1" in row
        queued, simulated, *_ = re.findall(r"\b\d+\b", row.split("advice-ip-127-0-0-1")[1])
        assert (int(queued), int(simulated)) == (40, 40)
        assert "other.test" not in dry.stdout  # its next hop is not the advice's
        assert "dry run: nothing installed" in dry.stdout
        policy = json.loads(_cli(srv.config, "policy", "show", "--json").stdout)
        assert "advice-advice-ip-127-0-0-1" not in json.dumps(policy)

        done = _cli(srv.config, "shaping", "apply", str(advice))
        assert done.returncode == 0, done.stderr
        audit_id = re.search(r"rollback (\d+)", done.stdout)
        assert audit_id, done.stdout
        running = _cli(srv.config, "why", "--help")  # the CLI still answers
        assert running.returncode == 0
        import urllib.request

        def api(path: str, method: str = "GET", body: bytes | None = None) -> dict:
            req = urllib.request.Request(f"http://127.0.0.1:{api_port}/api/v1{path}",
                                         data=body, method=method,
                                         headers={"Authorization": f"Bearer {TOKEN}",
                                                  "Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read())

        text = json.dumps(api("/policy")["policy"])
        assert "advice-advice-ip-127-0-0-1" in text and "9/60" in text
        record = api(f"/audit/{audit_id.group(1)}")
        assert record["reversible"] and "sluice shaping apply" in record["reason"]

        back = _cli(srv.config, "policy-audit", "rollback", audit_id.group(1),
                    "--reason", "advice was wrong")
        assert back.returncode == 0, back.stderr
        assert "advice-advice-ip-127-0-0-1" not in json.dumps(api("/policy")["policy"])
    finally:
        assert srv.stop() == 0


def test_advice_that_is_not_a_condition_is_refused_in_one_line(tmp_path: Path) -> None:
    api_port = free_port()
    srv = start_serve(tmp_path, api={"enabled": True, "listen": f"127.0.0.1:{api_port}",
                                     "tokens": {"ops": TOKEN}})
    try:
        bad = tmp_path / "bad.yaml"
        bad.write_text("rules:\n- name: pause\n  where: {mx: '*.example.net'}\n"
                       "  reply: {code: 421}\n  action: suspend\n")
        out = _cli(srv.config, "shaping", "apply", str(bad), "--dry-run")
        assert out.returncode == 2
        assert out.stderr.strip().count("\n") == 0 and "action suspend" in out.stderr
        assert str(bad) in out.stderr
    finally:
        assert srv.stop() == 0
