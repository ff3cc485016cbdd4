"""Resends on a real `sluice serve` (receiving process, queue manager, sink): SMTP
with smtpd.dedupe, and the HTTP injection API's Idempotency-Key header."""

from __future__ import annotations

import json
import smtplib
from collections.abc import Iterator
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import pytest

from tests.integration.serving import wait_until
from tests.integration.test_api_support import ApiServer, api_server, start_api_server
from tests.integration.test_metrics import scrape, total

pytestmark = pytest.mark.integration

SENDER = "app@client.example"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    tmp = tmp_path_factory.mktemp("dedupe")
    with api_server(tmp, smtpd={"dedupe": True, "relay_domains": ["resend.example"]}) as s:
        yield s


def message(msg_id: str, body: str = "Hello once.") -> EmailMessage:
    msg = EmailMessage()
    msg["From"], msg["To"], msg["Subject"] = SENDER, "you@resend.example", "once"
    msg["Message-ID"] = msg_id
    msg.set_content(body)
    return msg


def send(srv: ApiServer, msg: EmailMessage, rcpts: list[str]) -> str:
    """smtplib.send_message; returns the queue id named in the reply to DATA."""
    with smtplib.SMTP("127.0.0.1", srv.serving.port, timeout=30) as c:
        c.ehlo()
        assert c.mail(SENDER)[0] == 250
        for r in rcpts:
            assert c.rcpt(r)[0] == 250
        code, text = c.data(msg.as_bytes())
    assert code == 250, text
    return text.decode().rsplit("queued as ", 1)[1].strip()


def accounting(srv: ApiServer, kind: str, rcpt: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(Path(srv.config.accounting.path).glob("sluice-acct-*.jsonl")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == kind and event["recipient"] == rcpt:
                out.append(event)
    return out


def delivered(srv: ApiServer, rcpt: str) -> int:
    return sum(1 for m in srv.sink.messages if rcpt in m.recipients)


def test_a_resent_message_is_answered_with_the_first_queue_id(srv: ApiServer) -> None:
    rcpts = ["a@resend.example", "b@resend.example"]
    first = send(srv, message("<r1@client.example>"), rcpts)
    again = send(srv, message("<r1@client.example>"), rcpts)
    assert again == first
    other = send(srv, message("<r1@client.example>", body="Hello twice."), rcpts)
    assert other != first
    # Queued once (a 'received' line is written before the 250), delivered once.
    assert [e["spid"] for e in accounting(srv, "received", rcpts[0])] == [first, other]
    assert [e["qid"] for e in accounting(srv, "duplicate", rcpts[1])] == [f"{first}-1"]
    assert wait_until(lambda: delivered(srv, rcpts[0]) == 2, 30)
    assert wait_until(lambda: srv.counts()["recipients"] == 0, 30)
    assert delivered(srv, rcpts[0]) == 2 and delivered(srv, rcpts[1]) == 2

    def duplicates() -> float:
        return total(scrape(srv), "sluice_recipients_total", event="duplicate")

    assert wait_until(lambda: duplicates() == 2, 30), scrape(srv)["sluice_recipients_total"]


def test_the_index_is_shared_by_the_receivers_and_outlives_a_restart(tmp_path: Path) -> None:
    rcpts = ["c@resend.example"]
    # Two receiving processes on one port: the kernel spreads the connections.
    srv = start_api_server(tmp_path, smtpd={"dedupe": True, "processes": 2,
                                            "relay_domains": ["resend.example"]})
    try:
        first = send(srv, message("<r2@client.example>"), rcpts)
        assert {send(srv, message("<r2@client.example>"), rcpts) for _ in range(5)} == {first}
        assert srv.close(keep_sink=True) == 0
        srv = start_api_server(tmp_path, reuse=srv)
        assert send(srv, message("<r2@client.example>"), rcpts) == first
        assert len(accounting(srv, "received", rcpts[0])) == 1
        assert len(accounting(srv, "duplicate", rcpts[0])) == 6
    finally:
        assert srv.close() == 0


def test_the_idempotency_key_header_queues_a_request_once(srv: ApiServer) -> None:
    body = {"messages": [{"envelope_sender": SENDER,
                          "content": "From: a@client.example\nSubject: s\n\nHi.\n",
                          "recipients": [{"email": "h1@http.example"},
                                         {"email": "h2@http.example",
                                          "idempotency_key": "own-h2"}]}]}
    key = {"Idempotency-Key": "order-4711"}
    first = srv.ok("POST", "/api/v1/inject", json=body, headers=key)
    assert (first["queued"], first["duplicates"]) == (2, 0)
    again = srv.ok("POST", "/api/v1/inject", json=body, headers=key)
    assert (again["queued"], again["duplicates"]) == (2, 2)
    assert [r["queue_id"] for r in again["messages"][0]["recipients"]] == \
        [r["queue_id"] for r in first["messages"][0]["recipients"]]
    # Another header value is another request.
    third = srv.ok("POST", "/api/v1/inject", json=body, headers={"Idempotency-Key": "order-4712"})
    assert third["duplicates"] == 1  # only h2, by its own key
    bad = srv.call("POST", "/api/v1/inject", json=body, headers={"Idempotency-Key": "a b"})
    assert bad.status_code == 422
    spec = srv.ok("GET", "/api/v1/openapi.json")
    params = spec["paths"]["/api/v1/inject"]["post"]["parameters"]
    assert any(p["name"] == "Idempotency-Key" and p["in"] == "header" for p in params)
