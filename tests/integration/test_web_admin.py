"""The web administration page in real headless Chromium (Debian's, driven by Playwright).

The test signs in with a token, reads the counts and the qshape table,
releases held mail by a selector (preview, then apply) and checks that
the queue changed and the mail reached the next hop, adds and lifts a
suspension, and keeps a screenshot under artifacts/ (printed).
Playwright never downloads a browser here: it drives /usr/bin/chromium.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.integration.serving import wait_until
from tests.integration.test_api_support import ALICE, ApiServer, api_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT = ROOT / "artifacts" / "web-admin.png"


@pytest.fixture
def browser() -> Iterator[Any]:
    if not os.path.exists(CHROMIUM) or shutil.which(CHROMIUM) is None:
        pytest.fail(f"{CHROMIUM} is needed for the web page test (apt-get install chromium)")
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def test_web_admin_page(tmp_path: Path, browser: Any) -> None:
    with api_server(tmp_path, scheduler={"suspensions": str(tmp_path / "susp.yaml")}) as srv:
        for i in range(3):
            srv.hold(f"s{i}@sender.example", [f"r{i}@web-a.example"])
        srv.hold("s@sender.example", ["x@web-b.example", "y@web-b.example"])
        # Data is shown as text, never parsed as HTML.
        srv.hold("s@sender.example", ["z@x<b>bold</b>.example"])
        run_page(srv, browser)


def run_page(srv: ApiServer, browser: Any) -> None:
    # Waits go through locators: the page's Content-Security-Policy forbids eval,
    # which Playwright's wait_for_function needs.
    from playwright.sync_api import expect

    expect.set_options(timeout=15_000)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(srv.url + "/")
    assert page.title() == "Sluice"
    assert page.is_hidden("#dashboard")

    # A wrong token is refused; the right one opens the dashboard.
    page.fill("#token", "not-the-right-token-0123")
    page.click("#login-button")
    expect(page.locator("#login-error")).to_contain_text("not accepted")
    assert page.is_hidden("#dashboard")
    page.fill("#token", ALICE)
    page.click("#login-button")
    page.wait_for_selector("#dashboard", state="visible")
    assert page.evaluate("sessionStorage.getItem('sluice.token')") == ALICE

    # The counts and the qshape table.
    expect(page.locator("#count-hold")).to_have_text("6")
    assert page.text_content("#count-recipients") == "6"
    assert page.text_content("#count-messages") == "5"
    page.wait_for_selector("#shape tbody tr")
    rows = {r[0]: r[1] for r in page.eval_on_selector_all(
        "#shape tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))")}
    assert rows["TOTAL"] == "6" and rows["web-a.example"] == "3" and rows["web-b.example"] == "2"
    assert rows["x<b>bold</b>.example"] == "1"
    assert page.eval_on_selector_all("#shape b", "els => els.length") == 0

    # Release web-a.example: preview first, then apply.
    page.fill("#reason", "browser test")
    page.select_option("#action", "release")
    page.fill("#sel-domain", "web-a.example")
    page.click("#preview")
    expect(page.locator("#action-result")).to_contain_text("would change 3 recipient")
    expect(page.locator("#apply")).to_have_text("Apply to 3")
    assert srv.counts(domain="web-a.example")["by_state"]["hold"] == 3  # not yet
    page.click("#apply")
    expect(page.locator("#action-result")).to_contain_text("release: changed 3")
    assert wait_until(lambda: srv.sink.snapshot().delivered["web-a.example"] == 3, 20)
    # The sink has them; the queue forgets them once the outcomes are recorded.
    assert wait_until(lambda: srv.counts(domain="web-a.example")["recipients"] == 0, 10)
    expect(page.locator("#count-hold")).to_have_text("3")

    # Suspend web-b.example for 10 minutes; it shows with its expiry.
    page.select_option("#suspend-field", "recipientdomain")
    page.fill("#suspend-value", "web-b.example")
    page.fill("#suspend-ttl", "10m")
    page.click("#suspend-button")
    page.wait_for_selector("#suspensions tbody tr")
    cells = page.eval_on_selector_all("#suspensions tbody tr td",
                                      "cells => cells.map(c => c.textContent)")
    assert cells[0] == "recipientdomain=web-b.example"
    assert cells[1].startswith("in 9m") or cells[1].startswith("in 10m")
    assert cells[2] == "browser test"
    manual = srv.ok("GET", "/api/v1/suspensions")["manual"]
    assert [s["id"] for s in manual] == ["recipientdomain=web-b.example"]

    # The audit history names who did what.
    expect(page.locator("#audit tbody tr").nth(1)).to_be_visible()
    expect(page.locator("#audit tbody tr").first).to_contain_text("suspension.add")
    audit = page.eval_on_selector_all(
        "#audit tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
    assert [r[2:5] for r in audit[:2]] == [
        ["alice", "suspension.add", "recipientdomain=web-b.example"],
        ["alice", "queue.release", "domain=web-a.example"]]
    delivered = page.locator("#throughput tr", has_text="delivered")
    expect(delivered.locator("td").nth(3)).to_have_text("3")
    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    print(f"\nweb admin screenshot: {SCREENSHOT}")

    # Lift the suspension from the page.
    page.click("#suspensions tbody button")
    expect(page.locator("#action-result")).to_contain_text("lifted recipientdomain=web-b")
    assert srv.ok("GET", "/api/v1/suspensions")["manual"] == []
    # Sign out: the token is gone.
    page.click("#logout")
    assert page.is_visible("#login")
    assert page.evaluate("sessionStorage.getItem('sluice.token')") is None
    assert errors == [], errors
    assert SCREENSHOT.stat().st_size > 10_000
