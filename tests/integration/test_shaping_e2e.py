"""Shaping end to end: `sluice serve` against a loopback sink that plays Gmail.

The sink answers ``421 4.7.28`` when more than LIMIT recipients arrive in
any WINDOW seconds, and ``550 5.1.1`` for unknown users.  Its MX host is
``mx1.gmail-smtp-in.l.google.com`` in a loopback DNS server, so the
shipped rule for ``*.google.com`` applies.  Run once without rules
(``delivery.shaping_defaults: false``) and once with the shipped ones;
the refused share of attempts is printed (docs/shaping.md quotes it).
Time is real but the provider's "minute" is a WINDOW of one second.
"""

from __future__ import annotations

import json
import smtplib
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, Envelope, Session

from tests.integration.serving import Serving, free_port, serving, wait_until
from tests.integration.test_delivery_peers import SOA, AuthoritativeDns, dns_server
from tests.integration.test_web_admin import browser  # noqa: F401  (the Chromium fixture)

pytestmark = pytest.mark.integration

LIMIT = 10
WINDOW_S = 1.0
MESSAGES = 120
UNKNOWN = 5
MX = "mx1.gmail-smtp-in.l.google.com"


@dataclass
class Provider:
    """An aiosmtpd handler that rate-limits recipients like a large provider."""

    times: deque[float] = field(default_factory=deque)
    lock: threading.Lock = field(default_factory=threading.Lock)
    log: list[tuple[float, str]] = field(default_factory=list)  # (when, "ok"|"421"|"550")
    delivered: list[str] = field(default_factory=list)

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, rcpt_options: list[str]) -> str:
        now = time.monotonic()
        with self.lock:
            if address.startswith("unknown"):
                self.log.append((now, "550"))
                return "550 5.1.1 The email account that you tried to reach does not exist."
            while self.times and self.times[0] <= now - WINDOW_S:
                self.times.popleft()
            if len(self.times) >= LIMIT:
                self.log.append((now, "421"))
                return ("421 4.7.28 [127.0.0.1] Gmail has detected an unusual rate of "
                        "unsolicited mail originating from your IP address.")
            self.times.append(now)
            self.log.append((now, "ok"))
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        with self.lock:
            self.delivered.extend(envelope.rcpt_tos)
        return "250 2.0.0 OK"

    def refused_share(self, since: float = 0.0) -> tuple[float, int]:
        with self.lock:
            tries = [kind for at, kind in self.log if at >= since and kind != "550"]
        return (tries.count("421") / len(tries) if tries else 0.0), len(tries)


@pytest.fixture(scope="module")
def dns() -> Iterator[AuthoritativeDns]:
    with dns_server() as server:
        server.add("provider.test", "SOA", SOA)
        server.add("provider.test", "MX", f"10 {MX}.")
        server.add(MX, "A", "127.0.0.1")
        yield server


def _send(port: int, i: int) -> None:
    rcpt = f"unknown{i}@provider.test" if i < UNKNOWN else f"user{i}@provider.test"
    with smtplib.SMTP("127.0.0.1", port, local_hostname="client.test") as c:
        c.sendmail("s@sender.test", [rcpt], f"Subject: m{i}\r\n\r\nbody {i}\r\n".encode())


def _api(srv: Serving, path: str, token: str) -> Any:
    port = srv.api_port  # type: ignore[attr-defined]
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:  # loopback only
        body = resp.read()
    return body if path == "/metrics" else json.loads(body)


def check_page(srv: Serving, token: str, page_browser: Any) -> str:
    """The web page lists the automatic action; its Lift button ends it."""
    from playwright.sync_api import expect

    expect.set_options(timeout=15_000)
    page = page_browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(15_000)
    page.goto(f"http://127.0.0.1:{srv.api_port}/")  # type: ignore[attr-defined]
    page.fill("#token", token)
    page.click("#login-button")
    page.wait_for_selector("#dashboard", state="visible")
    table = page.locator("#shaping tbody")
    expect(table).to_contain_text("gmail-rate")
    expect(table).to_contain_text("backed off to concurrency 5")
    text = str(table.inner_text())
    page.locator("#shaping tbody button").first.click()
    expect(page.locator("#shaping tbody tr")).to_have_count(0)
    expect(page.locator("#shaping-summary")).to_contain_text("0 groups backed off")
    page.close()
    return text


def run(tmp: Path, dns: AuthoritativeDns, *, rules: bool,
        page_browser: Any = None) -> tuple[Provider, dict[str, Any]]:
    tmp.mkdir(parents=True, exist_ok=True)
    provider = Provider()
    sink_port = free_port()
    controller = Controller(provider, hostname="127.0.0.1", port=sink_port)
    controller.start()
    api_port = free_port()
    token = "t0ken-for-shaping-tests"
    seen: dict[str, Any] = {}
    try:
        with serving(tmp, delivery={"port": sink_port, "shaping_defaults": rules,
                                    "resolver": {"nameservers": ["127.0.0.1"],
                                                 "port": dns.port,
                                                 "inet_protocols": ["ipv4"]}},
                     queue={"retry_delays": "1s | 2s | 3s"},
                     api={"enabled": True, "listen": f"127.0.0.1:{api_port}",
                          "tokens": [token]}) as srv:
            srv.api_port = api_port  # type: ignore[attr-defined]
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda i: _send(srv.port, i), range(MESSAGES)))
            if rules:
                # While mail waits: the action shows in why, metrics, audit.
                assert wait_until(lambda: b"sluice_shaping_firings_total{rule=\"gmail-rate\"}"
                                  in _api(srv, "/metrics", token), 30)
                seen["metrics"] = _api(srv, "/metrics", token).decode()
                seen["audit"] = _api(srv, "/api/v1/audit", token)

                def why_names_the_rule() -> bool:
                    page = _api(srv, "/api/v1/queue/entries?limit=200", token)
                    for entry in page["entries"]:
                        qid = entry["qid"]
                        try:
                            lines = _api(srv, f"/api/v1/queue/entries/{qid}/why", token)
                        except OSError:
                            continue
                        text = "\n".join(line for e in lines["explanations"]
                                         for line in e["lines"])
                        if "rule gmail-rate" in text:
                            seen["why"] = text
                            return True
                    return False

                seen["why_found"] = wait_until(why_names_the_rule, 20, step=0.2)
                seen["status"] = srv.run("shaping", "status").stdout
            delivered_all = wait_until(lambda: srv.recipients_left() == 0, 240, step=0.5)
            seen["left"] = srv.recipients_left()
            assert delivered_all, f"{seen['left']} recipients still queued"
            if page_browser is not None:
                seen["page"] = check_page(srv, token, page_browser)
                seen["after_lift"] = _api(srv, "/api/v1/shaping", token)
                seen["audit_after"] = _api(srv, "/api/v1/audit", token)
    finally:
        controller.stop()
    return provider, seen


def test_default_rules_bring_the_refused_share_below_ten_percent(
        tmp_path: Path, dns: AuthoritativeDns, browser: Any) -> None:  # noqa: F811
    without, _ = run(tmp_path / "without", dns, rules=False)
    with_rules, seen = run(tmp_path / "with", dns, rules=True, page_browser=browser)
    share_without, tries_without = without.refused_share()
    share_with, tries_with = with_rules.refused_share()
    # After the first firing (and a hold time), the provider is respected.
    first = next(at for at, kind in with_rules.log if kind == "421")
    late_share, late_tries = with_rules.refused_share(first + 5.0)
    print(f"\nrefused share without rules: {share_without:.1%} of {tries_without} attempts;"
          f" with the shipped rules: {share_with:.1%} of {tries_with} attempts, "
          f"{late_share:.1%} of {late_tries} from 5 s after the first refusal")
    # Nothing lost: every known user delivered exactly once, in both runs.
    expected = sorted(f"user{i}@provider.test" for i in range(UNKNOWN, MESSAGES))
    assert sorted(without.delivered) == expected
    assert sorted(with_rules.delivered) == expected
    assert share_without > 0.5
    assert late_share < 0.10 and late_tries > 50
    assert "sluice_shaping_backoff_groups" in seen["metrics"]
    assert "backed off to concurrency 5, rate 5/1 by rule gmail-rate" in seen["status"]
    assert seen["why_found"], "no queued entry's why named the rule"
    assert "after reply \"421 4.7.28" in seen["why"] and f"from host {MX}" in seen["why"]
    actions = [r["action"] for r in seen["audit"]["records"]]
    assert "shaping.fire" in actions
    fire = next(r for r in seen["audit"]["records"] if r["action"] == "shaping.fire")
    assert fire["after"]["rule"] == "gmail-rate"
    assert "4.7.28" in fire["after"]["reply"] and fire["after"]["host"] == MX
    # The web page showed it and lifted it; the lift is audited.
    assert "gmail-rate" in seen["page"]
    assert seen["after_lift"]["active"] == []
    ends = [r for r in seen["audit_after"]["records"] if r["action"] == "shaping.end"]
    assert ends and ends[0]["reason"] == "lifted" and ends[0]["who"] == "api"
