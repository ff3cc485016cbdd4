"""POST /api/v1/inject on a real `sluice serve`: queued durably, delivered, idempotent,
and turned away with Retry-After when the queue is full or the store slow."""

from __future__ import annotations

import email
from collections.abc import Iterator
from email import policy
from pathlib import Path
from typing import Any

import pytest

from sluice.model import QueueState
from sluice.suppression import SuppressionEntry, SuppressionReason, write_suppression_list
from tests.integration.serving import wait_until
from tests.integration.test_api_support import BOB, ApiServer, api_server

pytestmark = pytest.mark.integration

SENDER = "news@shop.example"
RAW = "From: Shop <news@shop.example>\nTo: you\nSubject: raw\n\nHello, raw.\n"
TEMPLATE = {"from": "Shop <news@shop.example>", "subject": "Hello {{ first }}",
            "text_body": "Dear {{ first }}, your code is {{ code }}.",
            "html_body": "<p>Dear {{ first }}, your code is <b>{{ code }}</b>.</p>",
            "headers": {"List-Unsubscribe": "<mailto:unsub@shop.example?subject={{ email }}>"}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    tmp = tmp_path_factory.mktemp("inject")
    listed = tmp / "suppression.jsonl"
    write_suppression_list(listed, [SuppressionEntry(
        "gone@listed.example", SuppressionReason.HARD, category="bad-mailbox", code=550,
        enhanced="5.1.1", response="user unknown", last_at=1.7e9)], generated_at=1.7e9)
    with api_server(tmp, suppression={"path": str(listed), "mode": "reject"}) as server:
        yield server


def inject(srv: ApiServer, *messages: dict[str, Any], token: str | None = None
           ) -> dict[str, Any]:
    kw = {"token": token} if token else {}
    return srv.ok("POST", "/api/v1/inject", json={"messages": list(messages)}, **kw)


def delivered_to(srv: ApiServer, rcpt: str) -> list[email.message.EmailMessage]:
    return [email.message_from_bytes(m.data, policy=policy.default)  # type: ignore[misc]
            for m in srv.sink.messages if rcpt in m.recipients]


def test_a_complete_message_is_queued_once_for_its_recipients(srv: ApiServer) -> None:
    rcpts = ["a@raw.example", "b@raw.example"]
    out = inject(srv, {"envelope_sender": SENDER, "content": RAW,
                       "recipients": [{"email": r} for r in rcpts], "tenant": "t1",
                       "job": "j1"})
    assert (out["queued"], out["refused"]) == (2, 0)
    got = out["messages"][0]["recipients"]
    spids = {r["queue_id"].rsplit("-", 1)[0] for r in got}
    assert len(spids) == 1 and [r["status"] for r in got] == ["queued", "queued"]
    assert wait_until(lambda: all(delivered_to(srv, r) for r in rcpts), 30)
    msg = delivered_to(srv, rcpts[0])[0]
    assert msg["Subject"] == "raw"
    assert "with HTTP id " + spids.pop() in msg["Received"]
    assert msg.get_content().strip() == "Hello, raw."


def test_a_template_is_rendered_per_recipient(srv: ApiServer) -> None:
    out = inject(srv, {
        "envelope_sender": SENDER, "content": TEMPLATE, "substitutions": {"code": "X"},
        "recipients": [
            {"email": "ann@tpl.example", "name": "Ann B", "substitutions": {"first": "Ann"}},
            {"email": "Bo@TPL.example", "substitutions": {"first": "Bo", "code": 7}},
            {"email": "cy@tpl.example"},  # no "first": refused, not sent with a gap
        ]})
    got = out["messages"][0]["recipients"]
    assert [r["status"] for r in got] == ["queued", "queued", "refused"]
    assert got[2]["code"] == 550 and "'first' is undefined" in got[2]["reason"]
    assert wait_until(lambda: delivered_to(srv, "Bo@tpl.example"), 30)
    assert wait_until(lambda: delivered_to(srv, "ann@tpl.example"), 30)
    ann = delivered_to(srv, "ann@tpl.example")[0]
    assert ann["Subject"] == "Hello Ann" and ann["To"] == "Ann B <ann@tpl.example>"
    assert ann["List-Unsubscribe"] == "<mailto:unsub@shop.example?subject=ann@tpl.example>"
    parts = {p.get_content_type(): p.get_content() for p in ann.iter_parts()}
    assert parts["text/plain"].strip() == "Dear Ann, your code is X."
    assert parts["text/html"].strip() == "<p>Dear Ann, your code is <b>X</b>.</p>"
    bo = delivered_to(srv, "Bo@tpl.example")[0]
    assert "your code is 7" in bo.get_body(("plain",)).get_content()


def test_bad_addresses_and_suppressed_recipients_are_refused(srv: ApiServer) -> None:
    out = inject(srv, {"envelope_sender": SENDER, "content": RAW, "recipients": [
        {"email": "no-at-sign.example"}, {"email": "a..b@x.example"},
        {"email": "gone@listed.example"}, {"email": "ok@münchen.example"}]})
    got = out["messages"][0]["recipients"]
    assert [(r["status"], r.get("code")) for r in got] == [
        ("refused", 553), ("refused", 553), ("refused", 550), ("queued", None)]
    assert got[2]["enhanced"] == "5.1.1" and "suppressed" in got[2]["reason"]
    # The IDN domain is queued, and so sent, in A-labels (the entry may be
    # delivered and gone before a look at the queue: the sink is the witness).
    assert got[3]["queue_id"]
    assert wait_until(lambda: delivered_to(srv, "ok@xn--mnchen-3ya.example"), 30)
    bad_sender = inject(srv, {"envelope_sender": "nobody", "content": RAW,
                              "recipients": [{"email": "x@y.example"}]})
    assert bad_sender["messages"][0]["recipients"][0]["code"] == 553


def test_the_same_key_is_queued_once(srv: ApiServer) -> None:
    message = {"envelope_sender": SENDER, "content": TEMPLATE, "substitutions": {"code": 1},
               "job": "idem", "recipients": [
                   {"email": "k1@idem.example", "substitutions": {"first": "K"},
                    "idempotency_key": "job-7:k1@idem.example"},
                   {"email": "k2@idem.example", "substitutions": {"first": "L"},
                    "idempotency_key": "job-7:k2@idem.example"}]}
    first = inject(srv, message)
    assert (first["queued"], first["duplicates"]) == (2, 0)
    again = inject(srv, message)  # a retried Spark task
    assert (again["queued"], again["duplicates"]) == (2, 2)
    assert [r["queue_id"] for r in again["messages"][0]["recipients"]] == \
        [r["queue_id"] for r in first["messages"][0]["recipients"]]
    assert wait_until(lambda: len(delivered_to(srv, "k1@idem.example")) >= 1, 30)
    # Another token has its own keys; a key reused for another recipient is refused.
    other = inject(srv, {**message, "recipients": message["recipients"][:1]}, token=BOB)
    assert other["duplicates"] == 0 and other["queued"] == 1
    wrong = inject(srv, {**message, "recipients": [
        {"email": "k3@idem.example", "substitutions": {"first": "M"},
         "idempotency_key": "job-7:k1@idem.example"}]})
    assert wrong["messages"][0]["recipients"][0]["reason"].startswith("the idempotency key "
                                                                      "was used for another")
    twice = inject(srv, {**message, "recipients": [
        {**message["recipients"][0], "idempotency_key": "dup"},
        {**message["recipients"][1], "idempotency_key": "dup"}]})
    assert [r["status"] for r in twice["messages"][0]["recipients"]] == ["queued", "refused"]
    assert wait_until(lambda: srv.counts(jobid="idem")["recipients"] == 0, 30)
    # Asked for three times under its key, delivered once.
    assert len(delivered_to(srv, "k2@idem.example")) == 1


def test_requests_need_a_token_and_a_sane_body(srv: ApiServer) -> None:
    body = {"messages": [{"envelope_sender": SENDER, "content": RAW,
                          "recipients": [{"email": "a@b.example"}]}]}
    assert srv.call("POST", "/api/v1/inject", json=body, token=None).status_code == 401
    both = {"messages": [{"envelope_sender": SENDER, "content": {"from": "a@b.example",
                                                                 "subject": "no body"},
                          "recipients": [{"email": "a@b.example"}]}]}
    assert srv.call("POST", "/api/v1/inject", json=both).status_code == 422
    headerless = inject(srv, {"envelope_sender": SENDER, "content": "just text",
                              "recipients": [{"email": "a@b.example"}]})
    assert headerless["messages"][0]["recipients"][0]["code"] == 554


def test_a_full_queue_is_answered_429_with_retry_after(tmp_path: Path) -> None:
    with api_server(tmp_path, api={"inject": {"max_queue": 3, "retry_after": "7s"}}) as srv:
        srv.hold(SENDER, [f"h{i}@hold.example" for i in range(4)])
        resp = srv.call("POST", "/api/v1/inject", json={"messages": [
            {"envelope_sender": SENDER, "content": RAW,
             "recipients": [{"email": "a@full.example"}]}]})
        assert resp.status_code == 429
        assert resp.headers["Retry-After"] == "7"
        assert resp.json()["error"] == "queue full"
        assert srv.counts()["by_state"].get(QueueState.HOLD.value) == 4
        assert srv.counts()["recipients"] == 4  # nothing of it was queued


def test_a_slow_store_is_answered_503_with_retry_after(tmp_path: Path) -> None:
    # Every real commit takes longer than 0 s: the second request finds the store
    # "slow" and is turned away until retry_after has passed since the sample.
    with api_server(tmp_path, api={"inject": {"max_commit_time": "0s",
                                              "retry_after": "30s"}}) as srv:
        body = {"messages": [{"envelope_sender": SENDER, "content": RAW,
                              "recipients": [{"email": "a@slow.example"}]}]}
        assert srv.call("POST", "/api/v1/inject", json=body).status_code == 200
        resp = srv.call("POST", "/api/v1/inject", json=body)
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "30"
        assert resp.json()["error"] == "store slow"
