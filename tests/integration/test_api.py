"""The REST API over real HTTP against a running `sluice serve`.

One server for the module (a real SQLite queue, a sink as the next hop);
each test works on domains of its own, so the tests do not see each
other's mail.  A second server, started and restarted in its own test,
shows that suspensions and the audit history survive a restart.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from sluice.api.client import explain
from tests.conftest import SLUICE, subprocess_env
from tests.integration.serving import wait_until
from tests.integration.test_api_support import (
    ALICE,
    BOB,
    ApiServer,
    api_server,
    start_api_server,
    unique,
)

pytestmark = pytest.mark.integration

POLICY = """\
- fields: [recipientdomain]
  concurrency: 10
- id: per-tenant
  fields: [tenantid]
  rate: 100/1
"""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    tmp = tmp_path_factory.mktemp("api")
    (tmp / "policy.yaml").write_text(POLICY)
    with api_server(tmp, scheduler={"policy": str(tmp / "policy.yaml"),
                                    "suspensions": str(tmp / "suspensions.yaml")}) as s:
        yield s


def qids_of(page: dict[str, object]) -> list[str]:
    return [e["qid"] for e in page["entries"]]  # type: ignore[attr-defined,index]


# -- authentication -------------------------------------------------------------------


def test_health_needs_no_token_and_everything_else_does(srv: ApiServer) -> None:
    resp = srv.call("GET", "/api/v1/health", token=None)
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok", "node": "test-node"}
    for path in ("/api/v1/queue/counts", "/api/v1/queue/entries", "/api/v1/policy",
                 "/api/v1/suspensions", "/api/v1/audit", "/api/v1/openapi.json", "/metrics",
                 "/api/v1/scheduler/stats"):
        resp = srv.call("GET", path, token=None)
        assert resp.status_code == 401, path
        assert resp.headers["www-authenticate"] == 'Bearer realm="sluice"'
        assert resp.json()["error"] == "unauthorized"
        wrong = srv.call("GET", path, token="not-the-token-0123456789")
        assert wrong.status_code == 401, path
        assert 'error="invalid_token"' in wrong.headers["www-authenticate"]
    # Not a bearer token at all.
    basic = srv.call("GET", "/api/v1/queue/counts", token=None,
                     headers={"Authorization": "Basic YWxpY2U6eA=="})
    assert basic.status_code == 401


def test_refused_requests_change_nothing(srv: ApiServer) -> None:
    domain = unique("auth")
    accepted = srv.hold("s@sender.example", [f"a@{domain}", f"b@{domain}"])
    before = srv.counts(domain=domain)
    assert before["by_state"]["hold"] == 2
    for token in (None, "wrong-token-0123456789abcdef", ALICE[:-1]):
        r = srv.call("POST", "/api/v1/queue/actions", token=token,
                     json={"action": "delete", "selector": {}, "all": True, "reason": "x"})
        assert r.status_code == 401
        r = srv.call("POST", f"/api/v1/queue/entries/{accepted.qids[0]}/actions/release",
                     token=token)
        assert r.status_code == 401
        r = srv.call("POST", "/api/v1/suspensions", token=token,
                     json={"fields": {"recipientdomain": domain}, "reason": "x"})
        assert r.status_code == 401
    assert srv.counts(domain=domain) == before
    assert not any(s["fields"].get("recipientdomain") == domain
                   for s in srv.ok("GET", "/api/v1/suspensions")["manual"])
    # The store agrees (read by the CLI, not through the API).
    out = subprocess.run([SLUICE, "-c", str(srv.serving.config), "qcount", "--json",
                          "--domain", domain], capture_output=True, text=True, check=True,
                         env=subprocess_env())
    assert json.loads(out.stdout)["by_state"]["hold"] == 2


def test_the_openapi_document_lists_every_operation(srv: ApiServer) -> None:
    doc = srv.ok("GET", "/api/v1/openapi.json")
    assert doc["openapi"].startswith("3.")
    paths = doc["paths"]
    for path, method in (
        ("/api/v1/health", "get"), ("/api/v1/queue/entries", "get"),
        ("/api/v1/queue/counts", "get"), ("/api/v1/queue/shape", "get"),
        ("/api/v1/queue/actions", "post"), ("/api/v1/queue/entries/{qid}", "get"),
        ("/api/v1/queue/entries/{qid}/actions/{action_name}", "post"),
        ("/api/v1/queue/entries/{qid}/priority/{value}", "post"),
        ("/api/v1/queue/entries/{qid}/why", "get"), ("/api/v1/messages/{spid}", "get"),
        ("/api/v1/policy", "get"), ("/api/v1/policy/reload", "post"),
        ("/api/v1/policy/conditions", "post"),
        ("/api/v1/policy/counters/{counter_id}/conditions/{condition_id}", "delete"),
        ("/api/v1/suspensions", "get"), ("/api/v1/suspensions", "post"),
        ("/api/v1/suspensions/{suspension_id}", "delete"), ("/api/v1/audit", "get"),
        ("/api/v1/audit/{record_id}/rollback", "post"), ("/metrics", "get"),
    ):
        assert method in paths[path], (path, method)
    assert doc["components"]["securitySchemes"]["token"]["scheme"] == "bearer"
    # Every operation but health declares the token and the error shape.
    for path, ops in paths.items():
        for method, op in ops.items():
            if path == "/api/v1/health":
                assert "security" not in op
                continue
            assert op["security"] == [{"token": []}], (path, method)
            assert op["responses"]["401"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorBody"}


# -- reading the queue ------------------------------------------------------------------------


def test_listing_pages_with_a_cursor_and_filters(srv: ApiServer) -> None:
    domain = unique("list")
    qids = []
    for i in range(12):
        acc = srv.hold(f"s{i}@sender.example", [f"r{i}@{domain}", f"r{i}@other-{domain}"],
                       tenantid="t-even" if i % 2 == 0 else "t-odd")
        qids.append(acc.qids[0])
    seen: list[str] = []
    after = None
    pages = 0
    while True:
        params = {"domain": domain, "limit": 5, **({"after": after} if after else {})}
        page = srv.ok("GET", "/api/v1/queue/entries", params=params)
        pages += 1
        seen += qids_of(page)
        assert all(e["domain"] == domain and e["state"] == "hold" for e in page["entries"])
        after = page["next"]
        if after is None:
            break
    assert pages == 3
    assert seen == qids  # every entry once, in queue-id (arrival) order
    odd = srv.ok("GET", "/api/v1/queue/entries",
                 params={"domain": domain, "tenantid": "t-odd", "limit": 100})
    assert qids_of(odd) == qids[1::2]
    by_qid = srv.ok("GET", "/api/v1/queue/entries", params={"qid": [qids[3], qids[7]]})
    assert qids_of(by_qid) == [qids[3], qids[7]]
    spid = qids[4].rsplit("-", 1)[0]
    whole = srv.ok("GET", "/api/v1/queue/entries", params={"qid": spid})
    assert len(whole["entries"]) == 2  # both recipients of the message
    none = srv.ok("GET", "/api/v1/queue/entries", params={"domain": domain, "state": "deferred"})
    assert none == {"entries": [], "next": None}
    entry = srv.ok("GET", f"/api/v1/queue/entries/{qids[0]}")
    assert entry["recipient"] == f"r0@{domain}"
    assert entry["sender"] == "s0@sender.example"
    assert entry["tenantid"] == "t-even"
    assert entry["dsn"] is False and entry["smtputf8"] is False
    flagged = srv.submit("s@sender.example", [f"utf8@{domain}"], hold=True, smtputf8=True)
    assert srv.ok("GET", f"/api/v1/queue/entries/{flagged.qids[0]}")["smtputf8"] is True


def test_counts_and_shape(srv: ApiServer) -> None:
    domain = unique("count")
    for _ in range(3):
        srv.hold("s@sender.example", [f"a@{domain}", f"b@{domain}"])
    counts = srv.counts(domain=domain)
    assert counts == {"messages": 3, "recipients": 6,
                      "by_state": {"hold": 6, "incoming": 0, "deferred": 0, "active": 0,
                                   "delivering": 0, "bounce": 0}}
    shape = srv.ok("GET", "/api/v1/queue/shape", params={"domain": domain})
    assert shape["buckets_min"] == [5, 10, 20, 40, 80, 160, 320, 640, 1280]
    assert shape["header"][0] == "T"
    assert shape["total"]["total"] == 6
    assert shape["rows"] == [{"domain": domain, "total": 6,
                              "buckets": [6, 0, 0, 0, 0, 0, 0, 0, 0, 0]}]
    srv.hold("s@sender.example", [f"c@{unique('count-other')}"])
    everything = srv.ok("GET", "/api/v1/queue/shape", params={"top": 1})
    assert len(everything["rows"]) == 1 and everything["domains"] >= 2


def test_one_message_with_its_recipients_and_history(srv: ApiServer) -> None:
    domain = unique("msg")
    acc = srv.hold("s@sender.example", [f"a@{domain}", f"b@{domain}"], jobid="job-7")
    srv.ok("POST", "/api/v1/queue/actions", json={
        "action": "priority", "priority": 1, "selector": {"qids": [acc.qids[1]]},
        "reason": "vip"})
    msg = srv.ok("GET", f"/api/v1/messages/{acc.spid}")
    assert msg["spid"] == acc.spid
    assert abs(msg["arrival_at"] - time.time()) < 60
    assert [e["qid"] for e in msg["recipients"]] == list(acc.qids)
    assert [e["priority"] for e in msg["recipients"]] == [0, 1]
    events = [(h["qid"], h["event"]) for h in msg["history"]]
    assert events == [(acc.qids[0], "received"), (acc.qids[1], "received"),
                      (acc.qids[1], "priority")]
    assert all(h["jobid"] == "job-7" for h in msg["history"])
    assert msg["history_files"] >= 1 and msg["history_truncated"] is False
    # A qid names the message too; an unknown SPID is a 404, a malformed one a 422.
    assert srv.ok("GET", f"/api/v1/messages/{acc.qids[0]}")["spid"] == acc.spid
    # A line edited by hand with values of the wrong type is left out, not a 500.
    log_file = max((srv.serving.dir / "log").glob("sluice-acct-*.jsonl"))
    with log_file.open("a") as f:
        f.write(json.dumps({**msg["history"][0], "size": "big", "event": "edited"},
                           separators=(",", ":")) + "\n")
    again = srv.ok("GET", f"/api/v1/messages/{acc.spid}")
    assert [h["event"] for h in again["history"]] == ["received", "received", "priority"]
    assert srv.call("GET", "/api/v1/messages/0123456789ABCDEF").status_code == 404
    bad = srv.call("GET", "/api/v1/messages/not-an-id")
    assert bad.status_code == 422 and bad.json()["error"] == "invalid request"


def test_history_outlives_the_message(srv: ApiServer) -> None:
    domain = unique("gone")
    acc = srv.hold("s@sender.example", [f"a@{domain}"])
    srv.ok("POST", "/api/v1/queue/actions",
           json={"action": "release", "selector": {"domain": domain}, "reason": "go"})
    assert wait_until(lambda: srv.counts(domain=domain)["recipients"] == 0, 20)
    msg = srv.ok("GET", f"/api/v1/messages/{acc.spid}")
    assert msg["recipients"] == []
    kinds = [h["event"] for h in msg["history"]]
    assert kinds[:2] == ["received", "released"]
    assert wait_until(lambda: "delivered" in [
        h["event"] for h in srv.ok("GET", f"/api/v1/messages/{acc.spid}")["history"]], 10)


def test_why_from_the_store_and_from_the_scheduler(srv: ApiServer) -> None:
    domain = unique("why")
    held = srv.hold("s@sender.example", [f"a@{domain}"])
    why = srv.ok("GET", f"/api/v1/queue/entries/{held.qids[0]}/why")
    (expl,) = why["explanations"]
    assert expl["source"] == "store" and expl["state"] == "hold"
    assert expl["reasons"][0]["kind"] == "held"
    assert expl["lines"][0] == f"{held.qids[0]}: hold"
    # Suspend the domain, then queue mail for it: the scheduler holds it in memory.
    srv.ok("POST", "/api/v1/suspensions", json={
        "fields": {"recipientdomain": domain}, "ttl": "10m", "reason": "why test"})
    live = srv.submit("s@sender.example", [f"b@{domain}"])

    def in_memory() -> bool:
        e = srv.ok("GET", f"/api/v1/queue/entries/{live.qids[0]}/why")["explanations"][0]
        return e["source"] == "memory"

    assert wait_until(in_memory, 15)
    expl = srv.ok("GET", f"/api/v1/queue/entries/{live.qids[0]}/why")["explanations"][0]
    kinds = [r["kind"] for r in expl["reasons"]]
    assert "suspended" in kinds
    reason = next(r for r in expl["reasons"] if r["kind"] == "suspended")
    assert reason["suspension"] == f"recipientdomain={domain}"
    assert reason["until_at"] is not None and reason["until_at"] > time.time()
    # The client function `sluice why` is meant to ask first gives the same answer.
    asked = explain(srv.config, live.qids[0])
    assert asked is not None and asked[0]["qid"] == live.qids[0]
    assert "suspended" in [r["kind"] for r in asked[0]["reasons"]]
    # Lift it: the mail goes to the sink.
    srv.ok("DELETE", f"/api/v1/suspensions/recipientdomain={domain}",
           params={"reason": "done"})
    assert wait_until(lambda: srv.sink.snapshot().delivered[domain] == 1, 20)
    assert explain(srv.config, "0123456789ABCDEF-0") == []
    assert srv.call("GET", "/api/v1/queue/entries/0123456789ABCDEF-0/why").status_code == 404


# -- acting on the queue -------------------------------------------------------------------------


def test_actions_with_dry_run_and_their_effect(srv: ApiServer) -> None:
    domain = unique("act")
    for i in range(4):
        srv.hold(f"s{i}@sender.example", [f"r{i}@{domain}"])
    sel = {"domain": domain}
    dry = srv.ok("POST", "/api/v1/queue/actions",
                 json={"action": "release", "selector": sel, "dry_run": True})
    assert dry["dry_run"] is True and dry["count"] == 4 and len(dry["qids"]) == 4
    assert dry["audit_id"] is None
    assert srv.counts(domain=domain)["by_state"]["hold"] == 4  # a dry run changes nothing
    # Nothing to retry among held entries, nothing to hold twice.
    assert srv.ok("POST", "/api/v1/queue/actions",
                  json={"action": "retry", "selector": sel, "dry_run": True})["count"] == 0
    none = srv.ok("POST", "/api/v1/queue/actions", json={
        "action": "release", "selector": {**sel, "states": ["deferred"]}, "dry_run": True})
    assert none["count"] == 0
    # Delete one by its id, release the rest: they are delivered to the sink.
    first = dry["qids"][0]
    deleted = srv.ok("POST", f"/api/v1/queue/entries/{first}/actions/delete",
                     json={"reason": "spam"})
    assert deleted["count"] == 1 and deleted["qids"] == [first]
    assert srv.call("GET", f"/api/v1/queue/entries/{first}").status_code == 404
    released = srv.ok("POST", "/api/v1/queue/actions",
                      json={"action": "release", "selector": sel, "reason": "ok"})
    assert released["count"] == 3 and released["audit_id"] is not None
    assert wait_until(lambda: srv.sink.snapshot().delivered[domain] == 3, 20)
    assert wait_until(lambda: srv.counts(domain=domain)["recipients"] == 0, 10)
    record = srv.ok("GET", f"/api/v1/audit/{released['audit_id']}")
    assert record["action"] == "queue.release" and record["who"] == "alice"
    assert record["after"]["count"] == 3 and record["reversible"] is False
    assert record["target"] == f"domain={domain}"


def test_bounce_sends_an_ndr_and_priority_is_set(srv: ApiServer) -> None:
    domain = unique("bnc")
    sender = f"owner@{unique('ndr')}"
    acc = srv.hold(sender, [f"x@{domain}"])
    pr = srv.ok("POST", "/api/v1/queue/actions", json={
        "action": "priority", "priority": 1, "selector": {"domain": domain}})
    assert pr["count"] == 1
    assert srv.ok("GET", f"/api/v1/queue/entries/{acc.qids[0]}")["priority"] == 1
    back = srv.ok("POST", f"/api/v1/queue/entries/{acc.qids[0]}/priority/0",
                  json={"reason": "one entry"})
    assert back["count"] == 1 and back["action"] == "priority"
    assert srv.ok("GET", f"/api/v1/queue/entries/{acc.qids[0]}")["priority"] == 0
    bounced = srv.ok("POST", "/api/v1/queue/actions",
                     json={"action": "bounce", "selector": {"qids": [acc.spid]},
                           "reason": "unwanted"})
    assert bounced["count"] == 1

    def ndr_arrived() -> bool:
        return any(m.recipients == (sender,) and m.sender == "<>" for m in srv.sink.messages)

    assert wait_until(ndr_arrived, 20)
    assert srv.sink.snapshot().delivered[domain] == 0


def test_refusals_of_actions(srv: ApiServer) -> None:
    empty = srv.call("POST", "/api/v1/queue/actions", json={"action": "delete"})
    assert empty.status_code == 400 and empty.json()["error"] == "empty selector"
    also = srv.call("POST", "/api/v1/queue/actions",
                    json={"action": "hold", "selector": {"states": []}})
    assert also.status_code == 400
    # The whole queue is allowed when asked for (a dry run here).
    whole = srv.ok("POST", "/api/v1/queue/actions",
                   json={"action": "delete", "all": True, "dry_run": True})
    assert whole["count"] == srv.counts()["recipients"]
    for body, path in (
        ({"action": "priority", "selector": {"domain": "x.example"}}, "priority"),
        ({"action": "priority", "priority": 2, "selector": {"domain": "x.example"}},
         "body.priority"),
        ({"action": "hold", "priority": 1, "selector": {"domain": "x.example"}}, "priority"),
        ({"action": "explode", "selector": {"domain": "x.example"}}, "body.action"),
        ({"action": "hold", "selector": {"qids": ["not-a-qid"]}}, "body.selector.qids[0]"),
        ({"action": "hold", "selector": {"domain": "x.example"}, "typo": 1}, "body.typo"),
        ({"action": "hold", "dry_run": "yes", "selector": {"domain": "x"}}, "body.dry_run"),
    ):
        resp = srv.call("POST", "/api/v1/queue/actions", json=body)
        assert resp.status_code == 422, (body, resp.text)
        assert resp.json()["error"].startswith("invalid")
        assert any(p["path"] == path for p in resp.json()["detail"]), resp.json()
    missing = srv.call("POST", "/api/v1/queue/entries/0123456789ABCDEF-3/actions/hold")
    assert missing.status_code == 404
    # JSON has one number type: 1.0 is a whole number, 1.5 is not.
    whole = srv.ok("POST", "/api/v1/queue/actions", json={
        "action": "priority", "priority": 1.0, "selector": {"domain": "x.example"},
        "dry_run": True})
    assert whole["action"] == "priority"
    half = srv.call("POST", "/api/v1/queue/actions", json={
        "action": "priority", "priority": 1.5, "selector": {"domain": "x.example"}})
    assert half.status_code == 422
    # One entry's priority has its own path: /actions/{name} takes no value.
    assert srv.call("POST", "/api/v1/queue/entries/0123456789ABCDEF-3/actions/priority"
                    ).status_code == 422
    assert srv.call("POST", "/api/v1/queue/entries/0123456789ABCDEF-3/priority/1"
                    ).status_code == 404


def test_errors_are_json_with_the_right_status(srv: ApiServer) -> None:
    nowhere = srv.call("GET", "/api/v1/nowhere")
    assert nowhere.status_code == 404 and nowhere.json() == {"error": "not found",
                                                             "detail": None}
    wrong = srv.call("PUT", "/api/v1/suspensions")
    assert wrong.status_code == 405
    assert set(wrong.headers["allow"].split(", ")) == {"GET", "POST"}
    # A body that is not JSON is the documented 400, whatever the operation:
    # malformed, empty, or not sent as application/json.
    for path in ("/api/v1/queue/actions", "/api/v1/suspensions", "/api/v1/policy/reload",
                 "/api/v1/policy/conditions", "/api/v1/audit/1/rollback"):
        for content, kind in ((b"{not json", "application/json"), (b"", "application/json"),
                              (b'{"reason": "x"}', "text/plain")):
            broken = srv.call("POST", path, content=content, headers={"Content-Type": kind})
            assert broken.status_code == 400, (path, content, kind, broken.text)
            assert broken.json()["error"] == "invalid JSON"
        # JSON of the wrong shape is a 422, as the document says.
        assert srv.call("POST", path, json=[1, 2]).status_code == 422
    huge = srv.call("POST", "/api/v1/suspensions",
                    json={"fields": {"recipientdomain": "x"}, "reason": "x" * (2 << 20)})
    assert huge.status_code == 413 and huge.json()["error"] == "too large"
    chunked = srv.http.post("/api/v1/suspensions", content=iter([b"[" * 65536] * 40),
                            headers={"Authorization": f"Bearer {ALICE}",
                                     "Content-Type": "application/json"})
    assert "content-length" not in chunked.request.headers
    assert chunked.status_code == 413 and chunked.json()["error"] == "too large"
    limit = srv.call("GET", "/api/v1/queue/entries", params={"limit": 5000})
    assert limit.status_code == 422 and limit.json()["detail"][0]["path"] == "query.limit"
    # The server is still well.
    assert srv.call("GET", "/api/v1/health", token=None).status_code == 200


# -- policy, suspensions and the audit history --------------------------------------------------


def test_suspensions_are_added_kept_on_disk_and_removed(srv: ApiServer) -> None:
    domain = unique("susp")
    added = srv.call("POST", "/api/v1/suspensions", token=BOB, json={
        "fields": {"recipientdomain": domain.upper(), "tenantid": "t1"}, "ttl": "30m",
        "reason": "tenant t1 floods " + domain, "tag": "incident-42"})
    assert added.status_code == 201
    susp = added.json()["suspension"]
    assert susp["id"] == f"recipientdomain={domain},tenantid=t1"  # domain lower-cased
    assert susp["fields"] == {"recipientdomain": domain, "tenantid": "t1"}
    assert 1790 < susp["expires_at"] - time.time() <= 1800
    listed = srv.ok("GET", "/api/v1/suspensions")["manual"]
    assert susp["id"] in [s["id"] for s in listed]
    on_disk = yaml.safe_load((srv.serving.dir / "suspensions.yaml").read_text())
    assert {"recipientdomain": domain, "tenantid": "t1", "id": susp["id"],
            "expires_at": susp["expires_at"], "tag": "incident-42",
            "reason": "tenant t1 floods " + domain} in on_disk
    record = srv.ok("GET", f"/api/v1/audit/{added.json()['audit_id']}")
    assert record["who"] == "bob" and record["action"] == "suspension.add"
    assert record["before"] is None and record["after"]["id"] == susp["id"]
    # The same fields again: Halon keeps one suspension and gives it the new expiry.
    again = srv.ok("POST", "/api/v1/suspensions", json={
        "fields": {"recipientdomain": domain, "tenantid": "t1"}, "ttl": "1h", "reason": "longer"})
    assert again["suspension"]["id"] == susp["id"]
    assert again["suspension"]["expires_at"] > susp["expires_at"] + 1700
    assert srv.ok("GET", f"/api/v1/audit/{again['audit_id']}")["before"]["expires_at"] == \
        susp["expires_at"]
    # An id taken by other fields, a pattern, an unknown field, no reason: refused.
    taken = srv.call("POST", "/api/v1/suspensions", json={
        "fields": {"recipientdomain": "other.example"}, "id": susp["id"], "reason": "x"})
    assert taken.status_code == 409
    for body in ({"fields": {"recipientdomain": "*.example"}, "reason": "x"},
                 {"fields": {"colour": "red"}, "reason": "x"},
                 {"fields": {}, "reason": "x"},
                 {"fields": {"recipientdomain": domain}},
                 {"fields": {"recipientdomain": domain}, "reason": "x", "ttl": "soon"},
                 {"fields": {"recipientdomain": domain}, "reason": "x", "ttl": "0"},
                 {"fields": {"recipientdomain": domain}, "reason": "x", "ttl": "367d"},
                 {"fields": {"recipientdomain": domain}, "reason": "x", "ttl": "1h",
                  "expires_at": time.time() + 60}):
        resp = srv.call("POST", "/api/v1/suspensions", json=body)
        assert resp.status_code == 422, (body, resp.text)
    # An expiry the server's clock has passed is a conflict with the state (409).
    past = srv.call("POST", "/api/v1/suspensions", json={
        "fields": {"recipientdomain": domain}, "reason": "x", "expires_at": time.time() - 10})
    assert past.status_code == 409, past.text
    removed = srv.ok("DELETE", f"/api/v1/suspensions/{susp['id']}", params={"reason": "over"})
    assert srv.ok("GET", f"/api/v1/audit/{removed['audit_id']}")["action"] == \
        "suspension.remove"
    assert susp["id"] not in [s["id"] for s in srv.ok("GET", "/api/v1/suspensions")["manual"]]
    on_disk = yaml.safe_load((srv.serving.dir / "suspensions.yaml").read_text()) or []
    assert all(s["id"] != susp["id"] for s in on_disk)
    assert srv.call("DELETE", f"/api/v1/suspensions/{susp['id']}",
                    params={"reason": "again"}).status_code == 404
    assert srv.call("DELETE", "/api/v1/suspensions/x").status_code == 422  # no reason


def test_a_suspension_holds_mail_until_it_is_rolled_back(srv: ApiServer) -> None:
    domain = unique("roll")
    added = srv.ok("POST", "/api/v1/suspensions", json={
        "fields": {"recipientdomain": domain}, "reason": "maintenance"})
    srv.submit("s@sender.example", [f"a@{domain}", f"b@{domain}"])
    time.sleep(1.5)
    assert srv.sink.snapshot().delivered[domain] == 0
    assert srv.counts(domain=domain)["recipients"] == 2
    undone = srv.ok("POST", f"/api/v1/audit/{added['audit_id']}/rollback",
                    json={"reason": "maintenance over"})
    assert undone["rolled_back"] == added["audit_id"]
    assert wait_until(lambda: srv.sink.snapshot().delivered[domain] == 2, 20)
    record = srv.ok("GET", f"/api/v1/audit/{added['audit_id']}")
    assert record["rolled_back_by"] == undone["audit_id"]
    rollback = srv.ok("GET", f"/api/v1/audit/{undone['audit_id']}")
    assert rollback["action"] == "rollback" and rollback["rollback_of"] == added["audit_id"]
    assert rollback["before"]["id"] == f"recipientdomain={domain}" and rollback["after"] is None
    twice = srv.call("POST", f"/api/v1/audit/{added['audit_id']}/rollback",
                     json={"reason": "again"})
    assert twice.status_code == 409 and "already rolled back" in twice.json()["detail"]
    not_undoable = srv.call("POST", f"/api/v1/audit/{undone['audit_id']}/rollback",
                            json={"reason": "x"})
    assert not_undoable.status_code == 409
    assert srv.call("POST", "/api/v1/audit/999999/rollback",
                    json={"reason": "x"}).status_code == 404


def test_conditions_are_added_removed_and_rolled_back(srv: ApiServer) -> None:
    domain = unique("cond")

    def conditions() -> list[dict[str, object]]:
        counter = srv.ok("GET", "/api/v1/policy")["policy"]["policies"][0]
        return list(counter.get("conditions", []))

    added = srv.call("POST", "/api/v1/policy/conditions", json={
        "counter": "recipientdomain", "if": {"recipientdomain": domain}, "concurrency": 1,
        "rate": "5/10", "ttl": "1h", "reason": "be gentle with " + domain})
    assert added.status_code == 201, added.text
    body = added.json()
    cid = body["condition"]["id"]
    assert cid.startswith("api-") and body["position"] == 0
    assert body["condition"]["then"] == {"concurrency": 1, "rate": "5/10"}
    assert conditions()[0]["id"] == cid
    second = srv.ok("POST", "/api/v1/policy/conditions", json={
        "counter": "recipientdomain", "if": {"recipientdomain": "*.slow.example"},
        "connectinterval": 2, "position": 5, "id": "slow-wild", "reason": "wildcards"})
    assert second["position"] == 1 and [c["id"] for c in conditions()] == [cid, "slow-wild"]
    # A field the counter does not count (a conflict with the running policy),
    # a bad rate, an unknown counter.
    bad = srv.call("POST", "/api/v1/policy/conditions", json={
        "counter": "recipientdomain", "if": {"tenantid": "t"}, "concurrency": 1, "reason": "x"})
    assert bad.status_code == 409
    assert bad.json()["detail"][0]["path"] == "condition.if.tenantid"
    assert srv.call("POST", "/api/v1/policy/conditions", json={
        "counter": "recipientdomain", "if": {"recipientdomain": "a"}, "rate": "fast",
        "reason": "x"}).status_code == 422
    assert srv.call("POST", "/api/v1/policy/conditions", json={
        "counter": "no-such", "if": {"recipientdomain": "a"}, "concurrency": 1,
        "reason": "x"}).status_code == 404
    # Remove the first; roll the removal back: it returns to its place.
    removed = srv.ok("DELETE", f"/api/v1/policy/counters/recipientdomain/conditions/{cid}",
                     params={"reason": "not needed"})
    assert [c["id"] for c in conditions()] == ["slow-wild"]
    srv.ok("POST", f"/api/v1/audit/{removed['audit_id']}/rollback",
           json={"reason": "needed after all"})
    assert [c["id"] for c in conditions()] == [cid, "slow-wild"]
    # Roll the second's addition back: gone.
    srv.ok("POST", f"/api/v1/audit/{second['audit_id']}/rollback", json={"reason": "undo"})
    assert [c["id"] for c in conditions()] == [cid]
    srv.ok("DELETE", f"/api/v1/policy/counters/recipientdomain/conditions/{cid}",
           params={"reason": "cleanup"})
    assert conditions() == []
    assert srv.call("DELETE", f"/api/v1/policy/counters/recipientdomain/conditions/{cid}",
                    params={"reason": "x"}).status_code == 404


def test_reload_refuses_a_broken_file_and_rolls_back(srv: ApiServer) -> None:
    policy_file = srv.serving.dir / "policy.yaml"
    original = policy_file.read_text()
    stamp = policy_file.stat()

    def rewrite(text: str) -> None:
        # Keep the old mtime, so that only the API reads the new text (the
        # server's own file watcher reloads on a changed mtime).
        policy_file.write_text(text)
        os.utime(policy_file, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))

    before = srv.ok("GET", "/api/v1/policy")
    try:
        rewrite("- fields: [recipientdomain, colour]\n  concurrency: -1\n")
        broken = srv.call("POST", "/api/v1/policy/reload", json={"reason": "try"})
        assert broken.status_code == 409  # the file on disk is the state the request meets
        paths = {p["path"] for p in broken.json()["detail"]}
        assert "[0].fields[1]" in paths and "[0].concurrency" in paths
        assert srv.ok("GET", "/api/v1/policy")["policy"] == before["policy"]  # kept
        rewrite("- fields: [localip]\n  concurrency: 7\n")
        reloaded = srv.ok("POST", "/api/v1/policy/reload", json={"reason": "new limits"},
                          token=BOB)
        assert reloaded["counters"] == 1
        now = srv.ok("GET", "/api/v1/policy")["policy"]["policies"]
        assert now == [{"id": "localip", "fields": ["localip"], "default": {"concurrency": 7}}]
        record = srv.ok("GET", f"/api/v1/audit/{reloaded['audit_id']}")
        assert record["who"] == "bob" and record["action"] == "policy.reload"
        assert record["before"]["policy"] == before["policy"]
        assert record["after"]["policy"]["policies"] == now
        srv.ok("POST", f"/api/v1/audit/{reloaded['audit_id']}/rollback",
               json={"reason": "back to the old limits"})
        assert srv.ok("GET", "/api/v1/policy")["policy"] == before["policy"]
        # A later reload moves the policy on: rolling the first back again is refused,
        # and rolling the later one back needs force once the policy changed under it.
        again = srv.ok("POST", "/api/v1/policy/reload", json={"reason": "again"})
        rewrite(original)
        srv.ok("POST", "/api/v1/suspensions", json={
            "fields": {"jobid": "reload-test"}, "reason": "not a policy change"})
        cond = srv.ok("POST", "/api/v1/policy/conditions", json={
            "counter": "localip", "if": {"localip": "192.0.2.1"}, "concurrency": 1,
            "reason": "moves the policy on"})
        refused = srv.call("POST", f"/api/v1/audit/{again['audit_id']}/rollback",
                           json={"reason": "x"})
        assert refused.status_code == 409 and "force" in refused.json()["detail"]
        srv.ok("POST", f"/api/v1/audit/{again['audit_id']}/rollback",
               json={"reason": "x", "force": True})
        assert srv.ok("GET", "/api/v1/policy")["policy"] == before["policy"]
        assert srv.call("POST", f"/api/v1/audit/{cond['audit_id']}/rollback",
                        json={"reason": "counter gone"}).status_code == 409
        srv.ok("DELETE", "/api/v1/suspensions/jobid=reload-test", params={"reason": "x"})
    finally:
        rewrite(original)


def test_audit_history_pages_newest_first(srv: ApiServer) -> None:
    domain = unique("aud")
    ids = []
    for i in range(3):
        ids.append(srv.ok("POST", "/api/v1/suspensions", json={
            "fields": {"recipientdomain": domain, "jobid": f"j{i}"}, "reason": f"r{i}"}
                          )["audit_id"])
    first = srv.ok("GET", "/api/v1/audit", params={"limit": 2})
    assert [r["id"] for r in first["records"]] == [ids[2], ids[1]]
    older = srv.ok("GET", "/api/v1/audit", params={"limit": 2, "before": first["next"]})
    assert older["records"][0]["id"] == ids[0]
    assert [r["reason"] for r in first["records"]] == ["r2", "r1"]
    for i in range(3):
        srv.ok("DELETE", f"/api/v1/suspensions/jobid=j{i},recipientdomain={domain}",
               params={"reason": "cleanup"})
    assert srv.call("GET", "/api/v1/audit/0").status_code == 422
    assert srv.call("GET", "/api/v1/audit/99999999").status_code == 404


def test_views_show_what_holds_mail(srv: ApiServer) -> None:
    domain = unique("zero")
    cond = srv.ok("POST", "/api/v1/policy/conditions", json={
        "counter": "recipientdomain", "if": {"recipientdomain": domain}, "concurrency": 0,
        "reason": "stop everything for " + domain})
    live = srv.submit("s@sender.example", [f"a@{domain}", f"b@{domain}"])

    def parked() -> list[dict[str, object]]:
        items = srv.ok("GET", "/api/v1/scheduler/subqueues", params={"limit": 1000})["items"]
        return [q for q in items if q["route"]["recipientdomain"] == domain]

    assert wait_until(lambda: bool(parked()) and parked()[0]["parked"] is True, 15)
    (sub,) = parked()
    assert sub["entries"] == 2 and sub["jobs"] == 1
    assert "concurrency 0" in sub["held_by"][0]
    over = srv.ok("GET", "/api/v1/scheduler/counters",
                  params={"exceeded": "true", "limit": 1000})["items"]
    mine = [c for c in over if c["key"] == {"recipientdomain": domain}]
    assert mine and mine[0]["concurrency"] == 0 and mine[0]["exceeded"] is True
    assert mine[0]["condition"] == cond["condition"]["id"] and mine[0]["waiting_subqueues"] == 1
    auto = srv.ok("GET", "/api/v1/suspensions", params={"limit": 1000})
    assert any(s["fields"] == {"recipientdomain": domain} and s["automatic"]
               for s in auto["automatic"])
    why = srv.ok("GET", f"/api/v1/queue/entries/{live.spid}/why")["explanations"]
    assert len(why) == 2 and all(e["source"] == "memory" for e in why)
    assert "concurrency" in [r["kind"] for r in why[0]["reasons"]]
    stats = srv.ok("GET", "/api/v1/scheduler/stats")["active_queue"]
    assert stats["parked_subqueues"] >= 1 and stats["queued_entries"] >= 2
    dests = srv.ok("GET", "/api/v1/scheduler/destinations", params={"limit": 1000})["items"]
    assert any(d["destination"] == sub["route"]["destination"] and d["queued_jobs"] >= 1
               for d in dests), (dests, sub)
    # Lift the limit: both go.
    srv.ok("POST", f"/api/v1/audit/{cond['audit_id']}/rollback", json={"reason": "enough"})
    assert wait_until(lambda: srv.sink.snapshot().delivered[domain] == 2, 20)


def test_scheduler_views(srv: ApiServer) -> None:
    stats = srv.ok("GET", "/api/v1/scheduler/stats")
    assert stats["node"] == "test-node" and stats["uptime_s"] > 0
    assert stats["active_queue"]["maxmemoryqueue"] == 10000
    assert stats["manager"]["delivered"] >= 0
    for path in ("/api/v1/scheduler/subqueues", "/api/v1/scheduler/counters",
                 "/api/v1/scheduler/destinations"):
        page = srv.ok("GET", path, params={"limit": 5})
        assert page["total"] >= len(page["items"])
    thr = srv.ok("GET", "/api/v1/throughput")
    assert set(thr["totals"]) == {"at", "accepted", "delivered", "deferred", "bounced"}


def test_cli_commands_talk_to_the_server(srv: ApiServer) -> None:
    domain = unique("cli")

    def sluice(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([SLUICE, "-c", str(srv.serving.config), *args],
                              capture_output=True, text=True, env=subprocess_env(),
                              timeout=60, check=check)

    out = sluice("suspend", "add", f"recipientdomain={domain}", "--ttl", "5m",
                 "--reason", "cli test").stdout
    assert f"suspended recipientdomain={domain}" in out
    assert f"recipientdomain={domain}" in sluice("suspend", "list").stdout
    listing = json.loads(sluice("suspend", "list", "--json").stdout)
    assert any(s["id"] == f"recipientdomain={domain}" for s in listing["manual"])
    audit = sluice("policy-audit", "list", "--limit", "1").stdout
    assert "alice  suspension.add" in audit and "cli test" in audit
    record_id = audit.split()[0].lstrip("#")
    sluice("policy-audit", "rollback", record_id, "--reason", "undo from cli")
    assert f"recipientdomain={domain}" not in sluice("suspend", "list").stdout
    again = sluice("policy-audit", "rollback", record_id, "--reason", "x", check=False)
    assert again.returncode == 1 and "already rolled back" in again.stderr
    bad = sluice("suspend", "add", "colour=red", "--reason", "x", check=False)
    assert bad.returncode == 2
    cond = sluice("condition", "add", "recipientdomain", f"recipientdomain={domain}",
                  "--concurrency", "3", "--reason", "cli").stdout
    assert "added condition api-" in cond
    cid = cond.split()[2]
    sluice("condition", "remove", "recipientdomain", cid, "--reason", "cli")
    wrong = subprocess.run([SLUICE, "-c", str(srv.serving.config), "suspend", "list"],
                           capture_output=True, text=True, timeout=60,
                           env=subprocess_env(SLUICE_API_TOKEN="wrong-token-0123456789"))
    assert wrong.returncode == 1 and "unauthorized (401)" in wrong.stderr


# -- across a restart -----------------------------------------------------------------------------


def test_suspensions_and_the_audit_history_survive_a_restart(tmp_path: Path) -> None:
    first = start_api_server(tmp_path, scheduler={"suspensions": str(tmp_path / "susp.yaml")})
    try:
        added = first.ok("POST", "/api/v1/suspensions", json={
            "fields": {"recipientdomain": "kept.example"}, "ttl": "1h", "reason": "stay"})
    finally:
        assert first.close(keep_sink=True) == 0
    second = start_api_server(tmp_path, reuse=first)
    try:
        manual = second.ok("GET", "/api/v1/suspensions")["manual"]
        assert [s["id"] for s in manual] == ["recipientdomain=kept.example"]
        assert manual[0]["reason"] == "stay"
        assert abs(manual[0]["expires_at"] - added["suspension"]["expires_at"]) < 0.01
        history = second.ok("GET", "/api/v1/audit")["records"]
        assert [r["id"] for r in history] == [added["audit_id"]]
        # Mail for it waits; the rollback, after the restart, lets it go.
        second.submit("s@sender.example", ["a@kept.example"])
        time.sleep(1.0)
        assert second.sink.snapshot().delivered["kept.example"] == 0
        second.ok("POST", f"/api/v1/audit/{added['audit_id']}/rollback",
                  json={"reason": "release after restart"})
        assert wait_until(lambda: second.sink.snapshot().delivered["kept.example"] == 1, 20)
        assert yaml.safe_load((tmp_path / "susp.yaml").read_text()) == []
        lines = (tmp_path / "queue" / "api-audit.jsonl").read_text().splitlines()
        assert [json.loads(line)["action"] for line in lines] == ["suspension.add", "rollback"]
    finally:
        assert second.close() == 0


def test_a_taken_api_port_stops_serve_with_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        from tests.integration.test_api_support import api_config

        path, _ = api_config(tmp_path, sink_port=9, api={"listen": f"127.0.0.1:{port}"})
        proc = subprocess.run([SLUICE, "-c", str(path), "serve"], capture_output=True,
                              text=True, env=subprocess_env(), timeout=60)
    assert proc.returncode == 2  # it cannot start: like a bad file
    assert f"api.listen 127.0.0.1:{port}: cannot listen" in proc.stderr
    assert "Traceback" not in proc.stderr
