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
    for i in range(3):
        rows.append(event("deferred", f"y{i}@example.net", 80.5 + i, remotemx="mx2.example.net",
                          duration_s=0.2, **CONN))
    # a destination that never throttles gets no advice
    rows.append(event("delivered", "z@quiet.example", 5, remotemx="mx.quiet.example"))
    # one throttling reply is an incident, not a limit: no advice
    rows.append(event("deferred", "o@once.example", 20, remotemx="mx.once.example",
                      duration_s=0.1, **RATE))
    # greylisting, however often, is not a throttle
    for i in range(6):
        rows.append(event("deferred", f"g{i}@grey.example", 30 + i, remotemx="mx.grey.example",
                          duration_s=0.1, code=451, enhanced="4.7.1",
                          response="Greylisted, please try again later"))
    # throttled at one a minute (reputation, not a rate): counted, no "1/60"
    for m in range(3):
        rows.append(event("delivered", f"s{m}@slow.example", 60 * m + 1,
                          remotemx="mx.slow.example", duration_s=0.1))
        rows.append(event("deferred", f"t{m}@slow.example", 60 * m + 2,
                          remotemx="mx.slow.example", duration_s=0.1, **RATE))
    # an MX that is an address is its own group, not "0-1"
    for i in range(3):
        rows.append(event("deferred", f"c{i}@ip.example", 40 + i, remotemx="10.0.0.1",
                          duration_s=0.1, **CONN))
    return rows


@pytest.fixture(scope="module")
def findings(spark):
    df = spark.createDataFrame([tuple(r[f] for f in EVENT_FIELDS) for r in _traffic()],
                               EVENT_SCHEMA)
    return [r.asDict() for r in throttle_findings(df).collect()]


def test_findings(findings):
    by_dest = {r["destination"]: r for r in findings}
    assert set(by_dest) == {"gsuite", "example-net", "once-example", "slow-example",
                            "ip-10-0-0-1"}  # greylisting is no finding at all
    once, slow = by_dest["once-example"], by_dest["slow-example"]
    assert (once["throttled"], once["rate_per_min"]) == (1, None)
    assert (slow["throttled"], slow["accepted_per_min"], slow["rate_per_min"]) == (3, 1, None)
    assert by_dest["ip-10-0-0-1"]["concurrency"] == 1
    g = by_dest["gsuite"]
    assert (g["attempts"], g["delivered"], g["throttled"], g["rate_throttles"]) == (80, 70, 10, 10)
    assert g["peak_per_min"] == 30
    assert g["accepted_per_min"] == 20
    assert g["rate_per_min"] == 18  # 90 % of 20
    assert g["concurrency"] is None  # rate wording only
    n = by_dest["example-net"]
    assert n["connection_throttles"] == 3
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
            "ip-10-0-0-1": ["10.0.0.1"],
        }}],
        "if": [
            {"remotemx": "#example-net", "concurrency": 4},
            {"remotemx": "#gsuite", "rate": "18/60"},
            {"remotemx": "#ip-10-0-0-1", "concurrency": 1},
        ],
    }]


def test_advice_as_shaping_rules(findings, tmp_path):
    from sluice.pipeline.advice import advice_rules, advice_yaml
    from sluice.shaping.rulefile import load_file
    from sluice.shaping.rules import Observation

    doc = advice_rules(limits_from_findings(findings), "2026-11-25T10:00:00Z")
    by_name = {r["name"]: r for r in doc["rules"]}
    assert set(by_name) == {"advice-example-net", "advice-example-net-2", "advice-gsuite",
                            "advice-gsuite-2", "advice-gsuite-3", "advice-ip-10-0-0-1"}
    assert [by_name[f"advice-gsuite{n}"]["where"]["mx"] for n in ("", "-2", "-3")] == [
        "*.google.com", "*.googlemail.com", "*.smtp.goog"]
    assert by_name["advice-gsuite"]["thresholds"] == {"rate": "18/60"}
    assert by_name["advice-example-net"]["thresholds"] == {"concurrency": 4}
    path = tmp_path / "advice.yaml"
    path.write_text(advice_yaml(doc, "advice"))
    loaded = {r.name: r for r in load_file(str(path))}  # the schema and the loader accept it
    from sluice.cli import main

    assert main(["shaping", "check", str(path)]) == 0  # each rule matches its own test reply
    def said(mx: str, code: int, enhanced: str, text: str) -> bool:
        obs = Observation(at=0.0, code=code, enhanced=enhanced, text=text,
                          recipientdomain="gmail.com", remotemx=mx)
        return any(r.matches(obs) for name, r in loaded.items() if "gsuite" in name)

    assert said("alt1.gmail-smtp-in.l.google.com", 421, "4.7.0", "Try again later")
    assert said("mx.googlemail.com", 451, "", "rate limited, slow down")
    assert not said("alt1.gmail-smtp-in.l.google.com", 451, "4.7.1", "Greylisted, try later")
    assert not said("alt1.gmail-smtp-in.l.google.com", 450, "4.2.1", "receiving too quickly")
    assert not said("mx.example.org", 421, "4.7.0", "Try again later")


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
    said = {"localip": "192.0.2.7", "remotemx": GMAIL, "remoteip": "203.0.113.1",
            "duration_s": 0.1}
    events = []
    for m in range(3):  # a minute each: 10 taken, then 2 throttled
        for i in range(12):
            reply = (Reply(250, "2.0.0", "ok") if i < 10
                     else Reply(421, "4.7.0", RATE["response"]))
            kind = EventKind.DELIVERED if i < 10 else EventKind.DEFERRED
            events.append(make_event(kind, entry, at + 60 * m + i, reply=reply, **said))
    log.record(events, now=at)
    log.close()
    result = run_shape(spark, [str(tmp_path / "log" / "*.jsonl")], str(tmp_path / "out"))
    text = Path(result.outputs["policy"]).read_text()
    assert text.startswith("# Pickup policy advised by `sluice analytics shape`")
    doc = yaml.safe_load(text)
    assert doc[0]["if"] == [{"remotemx": "#gsuite", "rate": "9/60"}]  # 90 % of 10 a minute
    rules_doc = yaml.safe_load(Path(result.outputs["shaping"]).read_text())
    assert [r["thresholds"] for r in rules_doc["rules"]] == [{"rate": "9/60"}] * 3  # 3 patterns
    from sluice.cli import main

    assert main(["policy", "validate", result.outputs["policy"]]) == 0
    if POLICY_SCHEMA.exists():  # the policy validator's schema, when it is there
        import json

        import jsonschema

        jsonschema.validate(doc, json.loads(POLICY_SCHEMA.read_text()))
