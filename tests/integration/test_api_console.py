"""The console's endpoints against a real `sluice serve`: a message's headers and body (the
body only for a token in api.body_tokens), the destination table, the charts."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

from sluice.sink import Behaviour
from tests.integration.serving import wait_until
from tests.integration.test_api_support import ALICE, BOB, api_server

pytestmark = [pytest.mark.integration]

RAW = (b"From: Ann <ann@sender.example>\r\nSubject: hello\r\nX-Folded: one\r\n two\r\n"
       b"\r\nthe secret body\r\n")


def test_headers_for_every_token_the_body_only_for_body_tokens(tmp_path: Path) -> None:
    with api_server(tmp_path, api={"body_tokens": ["bob"]}) as srv:
        spid = srv.hold("ann@sender.example", ["r@held.example"], body=RAW).spid
        head = srv.ok("GET", f"/api/v1/messages/{spid}/headers")
        assert head["spid"] == spid and head["truncated"] is False
        assert [(h["name"], h["value"]) for h in head["headers"]] == [
            ("From", "Ann <ann@sender.example>"), ("Subject", "hello"),
            ("X-Folded", "one two")]
        assert head["body_allowed"] is False
        assert "secret" not in srv.call("GET", f"/api/v1/messages/{spid}/headers").text
        refused = srv.call("GET", f"/api/v1/messages/{spid}/body", token=ALICE)
        assert refused.status_code == 403 and "api.body_tokens" in refused.json()["detail"]
        assert srv.ok("GET", f"/api/v1/messages/{spid}/headers", token=BOB)["body_allowed"]
        body = srv.ok("GET", f"/api/v1/messages/{spid}/body", token=BOB)
        assert body["text"].endswith("the secret body\r\n") and body["truncated"] is False
        assert body["bytes"] == len(body["text"].encode())
        gone = srv.call("GET", "/api/v1/messages/0000000000000000/headers")
        assert gone.status_code == 404
        assert srv.call("GET", f"/api/v1/messages/{spid}/headers", token=None).status_code == 401


def test_destinations_and_charts_follow_what_happens(tmp_path: Path) -> None:
    # One deferral and no retry while the test looks.
    with api_server(tmp_path, queue={"retry_delays": "1h"}) as srv:
        srv.sink.behaviours["slow.example"] = Behaviour("tempfail")
        srv.submit("s@sender.example", ["a@ok.example", "b@ok.example"])
        srv.submit("s@sender.example", ["c@slow.example"])

        def table(**params: object) -> dict[str, dict[str, object]]:
            items = srv.ok("GET", "/api/v1/destinations", params=params)["items"]
            return {r["destination"]: r for r in items}

        assert wait_until(lambda: table().get("ok.example", {}).get("delivered_5m") == 2
                          and table().get("slow.example", {}).get("deferred_5m") == 1, 20)
        rows = table()
        ok, slow = rows["ok.example"], rows["slow.example"]
        assert (ok["delivered_1h"], ok["deferred_1h"], ok["bounced_1h"]) == (2, 0, 0)
        assert str(ok["last_reply"]).startswith("250")
        assert str(slow["last_reply"]).startswith("4") and slow["last_host"]
        assert set(table(q="SLOW")) == {"slow.example"}
        assert table(state="dead") == {}
        ordered = srv.ok("GET", "/api/v1/destinations",
                         params={"sort": "deferred_1h", "desc": "true"})["items"]
        assert ordered[0]["destination"] == "slow.example"
        assert srv.ok("GET", "/api/v1/destinations", params={"limit": 1})["total"] >= 2

        def charts() -> dict[str, Any]:
            got: dict[str, Any] = srv.ok("GET", "/api/v1/charts",
                                         params={"window_s": 300, "step_s": 5})
            return got

        def total(c: dict[str, Any], kind: str) -> float:
            # Rates are per second, averaged over steps of 5 s (the last one partial).
            last = c["rates"][-1]
            span = min(5.0, int(c["at"]) - last["at"])
            return sum(p[kind] * 5 for p in c["rates"][:-1]) + last[kind] * span

        # The current second is still filling: it shows once it is over.
        assert wait_until(lambda: total(charts(), "delivered") >= 2, 5)
        c = charts()
        assert c["step_s"] == 5 and len(c["rates"]) in (60, 61)
        assert total(c, "delivered") == pytest.approx(2.0)
        assert total(c, "accepted") == pytest.approx(3.0)
        assert total(c, "deferred") == pytest.approx(1.0)
        [reason] = c["reasons"]
        assert reason["count"] == 1 and reason["reason"].startswith("4")
        assert c["queue"] and c["queue"][-1]["recipients"] >= 0
        assert wait_until(lambda: any(
            q["by_state"].get("deferred") == 1
            for q in srv.ok("GET", "/api/v1/charts")["queue"]), 25)


def test_destination_states_suspended_then_dead(tmp_path: Path) -> None:
    # A port bound but not listening refuses connections, and nothing else
    # can take it while the test runs (a free port could be taken by a
    # server that accepts and never answers, and the relay never dies).
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    relay = f"smtp:[127.0.0.1]:{holder.getsockname()[1]}"
    with holder, api_server(tmp_path, queue={"retry_delays": "1h"},
                    delivery={"transport": {"*": relay}},
                    scheduler={"suspensions": str(tmp_path / "susp.yaml")}) as srv:
        srv.ok("POST", "/api/v1/suspensions", json={
            "fields": {"recipientdomain": "paused.example"}, "ttl": "10m", "reason": "test"})
        srv.submit("s@sender.example", ["a@paused.example"])

        def row() -> dict[str, Any]:
            items = srv.ok("GET", "/api/v1/destinations", params={"q": relay})["items"]
            return items[0] if items else {}

        # Every sub-queue waiting for the relay is suspended: so is the relay.
        assert wait_until(lambda: row().get("state") == "suspended", 20)
        r = row()
        assert r["queued"] == 1 and r["until_at"] == pytest.approx(time.time() + 600, abs=30)
        assert r["held_by"] == ["suspension recipientdomain=paused.example"]
        only = srv.ok("GET", "/api/v1/destinations", params={"state": "suspended"})["items"]
        assert [d["destination"] for d in only] == [relay]

        # Mail that may go finds nobody listening: after a cohort of failures (the
        # slow-start window: 2) the relay is dead for a while.
        for i in range(4):
            srv.submit("s@sender.example", [f"b{i}@go{i}.example"])
        ok = wait_until(lambda: row().get("state") == "dead", 20)
        assert ok, (row(), srv.ok("GET", "/api/v1/scheduler/destinations"),
                    srv.ok("GET", "/api/v1/queue/entries"))
        r = row()
        assert r["until_at"] == pytest.approx(time.time() + 300, abs=30)
        first = srv.ok("GET", "/api/v1/destinations")["items"][0]
        assert first["destination"] == relay  # trouble first
