"""Shaping advice: throttling found per destination, written as a pickup policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sluice.accounting import EVENT_FIELDS
from sluice.pipeline.policy import DestinationLimit, build_policy, limits_from_findings
from sluice.pipeline.schema import EVENT_SCHEMA
from sluice.pipeline.shape import throttle_findings
from tests.spark.frames import event

pytestmark = pytest.mark.spark

POLICY_SCHEMA = Path(__file__).resolve().parents[2] / "src/sluice/schemas/policy.schema.json"
GMAIL = "gmail-smtp-in.l.google.com"
RATE = {"code": 421, "enhanced": "4.7.0",
        "response": "Try again later, closing connection. (rate limited)"}
CONN = {"code": 421, "enhanced": "4.7.0", "response": "Too many concurrent SMTP connections"}


def _traffic():
    rows = []
    # Google, from 192.0.2.1: minute 0 accepts 30 without complaint; minutes
    # 1 and 2 accept 20 each and throttle 5 each.
    for m, (ok, thr) in enumerate([(30, 0), (20, 5), (20, 5)]):
        for i in range(ok):
            rows.append(event("delivered", f"u{m}-{i}@gmail.com", 60 * m + i,
                              remotemx=GMAIL, duration_s=0.5))
        for i in range(thr):
            rows.append(event("deferred", f"t{m}-{i}@gmail.com", 60 * m + 30 + i,
                              remotemx=GMAIL, duration_s=0.1, **RATE))
    # example.net: four long deliveries in flight, then a connection throttle
    # while the four are still open.
    for i in range(4):
        rows.append(event("delivered", f"x{i}@example.net", 100 + i, remotemx="mx1.example.net",
                          duration_s=50.0))
    rows.append(event("deferred", "y@example.net", 80.5, remotemx="mx2.example.net",
                      duration_s=0.2, **CONN))
    # a destination that never throttles gets no advice
    rows.append(event("delivered", "z@quiet.example", 5, remotemx="mx.quiet.example"))
    return rows


@pytest.fixture(scope="module")
def findings(spark):
    df = spark.createDataFrame([tuple(r[f] for f in EVENT_FIELDS) for r in _traffic()],
                               EVENT_SCHEMA)
    return [r.asDict() for r in throttle_findings(df).collect()]


def test_findings(findings):
    by_dest = {r["destination"]: r for r in findings}
    assert set(by_dest) == {"gsuite", "example-net"}
    g = by_dest["gsuite"]
    assert (g["attempts"], g["delivered"], g["throttled"], g["rate_throttles"]) == (80, 70, 10, 10)
    assert g["peak_per_min"] == 30
    assert g["accepted_per_min"] == 20
    assert g["rate_per_min"] == 18  # 90 % of 20
    assert g["concurrency"] is None  # rate wording only
    n = by_dest["example-net"]
    assert n["connection_throttles"] == 1
    # 50 s deliveries started at 50..53 s; the throttled attempt started at
    # 80.3 s with those four open: five in flight, advice one less.
    assert n["inflight_at_throttle"] == 5
    assert n["concurrency"] == 4


def test_policy_document(findings):
    policy = build_policy(limits_from_findings(findings))
    assert policy == [{
        "fields": ["localip", {"remotemx": {
            "example-net": ["*.example.net", "example.net"],
            "gsuite": ["*.google.com", "*.googlemail.com", "*.smtp.goog"],
        }}],
        "if": [
            {"remotemx": "#example-net", "concurrency": 4},
            {"remotemx": "#gsuite", "rate": "18/60"},
        ],
    }]


def test_limits_combine_per_destination():
    rows = [
        {"destination": "gsuite", "sample_mx": GMAIL, "rate_per_min": 30, "concurrency": None,
         "connectinterval_s": 2.0, "throttled": 3},
        {"destination": "gsuite", "sample_mx": GMAIL, "rate_per_min": 12, "concurrency": 5,
         "connectinterval_s": 4.0, "throttled": 2},
    ]
    assert limits_from_findings(rows) == [DestinationLimit(
        "gsuite", ("*.google.com", "*.googlemail.com", "*.smtp.goog"),
        rate_per_min=12, concurrency=5, connectinterval_s=4.0, throttled=5)]


def test_shape_job_writes_yaml(spark, tmp_path):
    from sluice.accounting import AccountingLog, EventKind, make_event
    from sluice.model import QueueEntry, QueueState, Reply
    from sluice.pipeline.jobs import run_shape

    at = 1_790_000_000.0
    log = AccountingLog(tmp_path / "log")
    entry = QueueEntry(spid="00000000AA", idx=0, sender="s@shop.test", recipient="a@gmail.com",
                       state=QueueState.ACTIVE, arrival_at=at, next_attempt_at=at)
    log.record([
        make_event(EventKind.DEFERRED, entry, at + 1, reply=Reply(421, "4.7.0", RATE["response"]),
                   localip="192.0.2.7", remotemx=GMAIL, remoteip="203.0.113.1", duration_s=0.1),
        make_event(EventKind.DELIVERED, entry, at + 2, reply=Reply(250, "2.0.0", "ok"),
                   localip="192.0.2.7", remotemx=GMAIL, remoteip="203.0.113.1", duration_s=0.1),
    ], now=at)
    log.close()
    result = run_shape(spark, [str(tmp_path / "log" / "*.jsonl")], str(tmp_path / "out"))
    text = Path(result.outputs["policy"]).read_text()
    assert text.startswith("# Pickup policy advised by `sluice analytics shape`")
    doc = yaml.safe_load(text)
    assert doc[0]["if"] == [{"remotemx": "#gsuite", "rate": "1/60"}]
    from sluice.cli import main

    assert main(["policy", "validate", result.outputs["policy"]]) == 0
    if POLICY_SCHEMA.exists():  # the policy validator's schema, when it is there
        import json

        import jsonschema

        jsonschema.validate(doc, json.loads(POLICY_SCHEMA.read_text()))
