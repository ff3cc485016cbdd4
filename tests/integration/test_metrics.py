"""/metrics of a running `sluice serve`, and the pieces that bound its labels."""

from __future__ import annotations

import json
import smtplib
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.accounting import session_event
from sluice.api.metrics import CANDIDATES, AccountingTail, DomainLabels, LabelLimiter, Metrics
from sluice.model import ClientSession
from sluice.sink import Behaviour
from tests.conftest import make_config
from tests.integration.serving import wait_until
from tests.integration.test_api_support import ApiServer, api_server

Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(srv: ApiServer) -> Samples:
    resp = srv.call("GET", "/metrics")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    out: Samples = defaultdict(list)
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            out[sample.name].append((dict(sample.labels), sample.value))
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, [])
               if all(lab.get(k) == want for k, want in labels.items()))


def send(port: int, rcpt: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, local_hostname="client.test") as c:
        c.sendmail("s@sender.example", [rcpt], b"Subject: m\r\n\r\nbody\r\n")


@pytest.mark.integration
def test_metrics_count_what_happened_with_bounded_labels(tmp_path: Path) -> None:
    api = {"metrics_domains": 2, "metrics_tenants": 1, "metrics_min_count": 1,
           "metrics_domain_groups": {"bigmail": ["*.big.example"]}}
    with api_server(tmp_path, api=api) as srv:
        srv.sink.behaviours.update({"bad.example": Behaviour("reject"),
                                    "grey.example": Behaviour("greylist")})
        assert srv.call("GET", "/metrics", token=None).status_code == 401
        port = srv.serving.port
        # Through SMTP (the receiving process writes "received"), in this order:
        for rcpt in ("u1@a.big.example", "u2@a.big.example", "u3@a.big.example",
                     "u1@b.big.example", "u2@b.big.example", "u@first.example",
                     "u@second.example", "u@third.example", "u@bad.example",
                     "u@grey.example"):
            send(port, rcpt)
        # Straight into the queue, with tenants: t1 gets the one tenant label.
        srv.submit("s@sender.example", ["x@c.big.example", "y@c.big.example"], tenantid="t1")
        srv.submit("s@sender.example", ["z@c.big.example"], tenantid="t2")
        srv.hold("s@sender.example", ["h1@held.example", "h2@held.example"])
        # 13 delivered: 10 through SMTP but the rejected one, 3 submitted, the NDR.
        assert wait_until(lambda: srv.sink.snapshot().total_delivered == 13, 30)

        def settled() -> bool:
            m = scrape(srv)
            # The log's lines (a delivery's comes before its commit) and the
            # queue manager's count (after it).
            return (total(m, "sluice_recipients_total", event="delivered") == 13
                    and total(m, "sluice_recipients_total", event="bounced") == 1
                    and total(m, "sluice_manager_recipients_total", event="delivered") == 13)

        assert wait_until(settled, 15, step=0.5)
        srv.ok("POST", "/api/v1/suspensions", json={
            "fields": {"recipientdomain": "paused.example"}, "reason": "metrics"})
        # Store counts are cached for a second per scrape.
        assert wait_until(lambda: total(scrape(srv), "sluice_queue_messages") == 1, 5, 0.3)
        m = scrape(srv)

    domains = {lab["domain"] for lab, _ in m["sluice_recipients_total"]}
    tenants = {lab["tenant"] for lab, _ in m["sluice_recipients_total"]}
    assert domains == {"bigmail", "first.example", "second.example", "other"}
    assert tenants == {"none", "t1", "other"}
    r = "sluice_recipients_total"
    assert total(m, r, event="accepted", domain="bigmail") == 8
    assert total(m, r, event="accepted", domain="bigmail", tenant="t1") == 2
    assert total(m, r, event="accepted", domain="bigmail", tenant="other") == 1
    assert total(m, r, event="accepted", domain="first.example") == 1
    # third, bad, grey, the 2 held, and the NDR to sender.example
    assert total(m, r, event="accepted", domain="other") == 6
    assert total(m, r, event="delivered", domain="bigmail") == 8
    assert total(m, r, event="bounced", domain="other") == 1
    assert total(m, r, event="deferred", domain="other") >= 1  # greylisted once
    # Messages: 10 through SMTP, 2 submitted, the held one and the NDR.
    assert total(m, "sluice_messages_accepted_total") == 14
    assert total(m, "sluice_message_bytes_accepted_total") > 14 * 20
    # Histograms: one latency per delivered recipient, one duration per attempt.
    assert total(m, "sluice_delivery_latency_seconds_count") == 13
    assert total(m, "sluice_delivery_attempt_seconds_count", outcome="delivered") == 13
    assert total(m, "sluice_delivery_attempt_seconds_bucket", outcome="delivered",
                 le="+Inf") == 13
    # The running parts.
    assert total(m, "sluice_up") == 1
    assert total(m, "sluice_queue_recipients", state="hold") == 2
    assert total(m, "sluice_queue_messages") == 1
    # The held message is the oldest (and only) entry; every state has a series.
    oldest = {lab["state"]: v for lab, v in m["sluice_queue_oldest_age_seconds"]}
    assert set(oldest) == {"incoming", "deferred", "active", "delivering", "bounce", "hold"}
    assert 0 < oldest["hold"] < 120 and oldest["incoming"] == 0
    assert total(m, "sluice_suspensions", kind="manual") == 1
    assert total(m, "sluice_delivery_connections_opened_total") >= 1
    assert ("sluice_delivery_connections" in m
            and {lab["state"] for lab, _ in m["sluice_delivery_connections"]} == {"open", "idle"})
    assert total(m, "sluice_manager_recipients_total", event="delivered") == 13
    assert total(m, "sluice_store_write_seconds_count", op="claim") > 0
    assert total(m, "sluice_store_write_seconds_count", op="apply") > 0
    # Only this process's writes are timed: here the NDR's submission (the receiving
    # processes, and this test, write through stores of their own).
    assert total(m, "sluice_store_write_seconds_count", op="submit") == 1
    assert total(m, "sluice_active_queue_limit_recipients") == 10000
    # Per tenant, with the accounting log's bounded labels: every pickup counted
    # once (13 deliveries and the greylisted retry's first try at least).
    assert total(m, "sluice_tenant_pickups_total") >= 14
    assert (total(m, "sluice_tenant_pickups_total", tenant="t1")
            + total(m, "sluice_tenant_pickups_total", tenant="other")) == 2
    assert {lab["tenant"] for lab, _ in m["sluice_tenant_pickups_total"]} <= {
        "none", "t1", "other"}
    assert "sluice_tenant_inflight_deliveries" in m and "sluice_tenant_queued_jobs" in m
    assert not any(name.endswith("_created") for name in m)


@pytest.mark.integration
def test_throughput_follows_the_accounting_log(tmp_path: Path) -> None:
    with api_server(tmp_path) as srv:
        for i in range(6):
            send(srv.serving.port, f"u{i}@tp.example")
        assert wait_until(lambda: srv.ok("GET", "/api/v1/throughput")["totals"]["delivered"]
                          == 6, 20, step=0.2)
        thr = srv.ok("GET", "/api/v1/throughput")
        assert thr["totals"]["accepted"] == 6
        assert thr["per_s_60s"]["delivered"] > 0
        assert thr["points"] and thr["points"][-1]["delivered"] <= 6


# -- the parts ---------------------------------------------------------------------------


@pytest.mark.unit
def test_label_limiter_admits_at_most_its_limit_and_keeps_them() -> None:
    lim = LabelLimiter(limit=2, min_count=3)
    assert [lim.label("a") for _ in range(3)] == ["other", "other", "a"]
    assert lim.label("") == "none"
    assert [lim.label("b") for _ in range(3)] == ["other", "other", "b"]
    assert [lim.label("c") for _ in range(10)] == ["other"] * 10  # full
    assert lim.label("a") == "a" and lim.label("b") == "b"  # for good
    assert lim.admitted == {"a", "b"}


@pytest.mark.unit
def test_label_limiter_forgets_noise_when_its_table_fills() -> None:
    lim = LabelLimiter(limit=5, min_count=4)
    for _ in range(3):
        lim.label("steady")
    for i in range(CANDIDATES + 10):  # a flood of one-off values
        assert lim.label(f"noise{i}") == "other"
    assert len(lim._candidates) <= CANDIDATES
    # The steady value kept part of its count and still gets its label.
    assert [lim.label("steady") for _ in range(3)][-1] == "steady"
    assert not any(v.startswith("noise") for v in lim.admitted)


@pytest.mark.unit
def test_domain_groups_come_before_the_limiter() -> None:
    labels = DomainLabels({"google": ["*.google.com", "gmail.com"], "ms": ["/outlook\\.com$/"]},
                          limit=1, min_count=1)
    assert labels.label("mx.google.com") == "google"
    assert labels.label("gmail.com") == "google"
    assert labels.label("eur.outlook.com") == "ms"
    assert labels.label("first.example") == "first.example"
    assert labels.label("second.example") == "other"


@pytest.mark.integration
def test_accounting_tail_reads_only_new_complete_lines(tmp_path: Path) -> None:
    old = tmp_path / "sluice-acct-20261122T09.jsonl"
    old.write_text(json.dumps({"event": "received"}) + "\n")
    tail = AccountingTail(tmp_path)
    tail.prime()
    seen: list[bytes] = []
    assert tail.poll(seen.append) == 0 and seen == []
    with old.open("a") as f:
        f.write('{"event": "delivered"}\n{"event": "def')  # the last line is not finished
    new = tmp_path / "sluice-acct-20261122T10.jsonl"
    new.write_text('{"event": "bounced"}\n')
    tail.poll(seen.append)
    assert [json.loads(x)["event"] for x in seen] == ["delivered", "bounced"]
    with old.open("a") as f:
        f.write('erred"}\n')
    tail.poll(seen.append)
    assert json.loads(seen[-1])["event"] == "deferred" and len(seen) == 3
    old.unlink()  # pruned by the accounting log: forgotten, no error
    assert tail.poll(seen.append) == 0


def test_session_lines_count_once_each_with_bounded_codes(tmp_path: Path) -> None:
    metrics = Metrics(make_config(tmp_path))
    me = metrics.node
    tls = ClientSession("192.0.2.7", "c.test", "TLSv1.3", "TLS_AES_256_GCM_SHA384", "bob")
    plain = ClientSession("192.0.2.8")
    for event in (
        session_event(tls, 10.0, node=me, started_at=9.0, refused={"535": 2, "554": 1},
                      auth_failures=2),
        session_event(plain, 11.0, node=me, refused={"299": 1, "x": 3, "451": 1},
                      tls_failure="SSLError: unsupported protocol"),
        session_event(plain, 11.0, node="another-node", auth_failures=5),
    ):
        metrics.observe(event)
    metrics.flush()
    m: Samples = defaultdict(list)
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            m[sample.name].append((dict(sample.labels), sample.value))
    assert total(m, "sluice_smtpd_connections_total") == 2  # not the other node's
    assert total(m, "sluice_smtpd_auth_failures_total") == 2
    assert total(m, "sluice_smtpd_tls_sessions_total") == 1
    assert total(m, "sluice_smtpd_tls_failures_total") == 1
    refused = "sluice_smtpd_commands_refused_total"
    assert total(m, refused, code="535") == 2 and total(m, refused, code="451") == 1
    assert total(m, refused, code="other") == 4  # not a 4xx/5xx code: no label of its own
    assert total(m, refused, code="550") == 0 and any(
        lab["code"] == "550" for lab, _ in m[refused])  # present at zero
    assert total(m, "sluice_recipients_total") == 0  # a session is no recipient
