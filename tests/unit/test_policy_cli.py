"""`sluice policy validate|show|schema`, `sluice simulate` and `sluice why`, run in-process.

They read real files, and `why` a real SQLite queue, so they are marked
integration although they live next to the policy's unit tests.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from sluice.cli import main
from sluice.model import Reply, Selector, Submission, TempFail
from sluice.policyfile import load_policy_file
from sluice.queue import AttemptResult, Queue
from sluice.store import Action
from tests.conftest import ROOT, make_config, write_config

pytestmark = pytest.mark.integration

POLICIES = ROOT / "examples" / "policies"
SCENARIOS = ROOT / "examples" / "scenarios"


@pytest.mark.parametrize("name", ["seed-localip.yaml", "seed-halon-io.yaml",
                                  "seed-groups.yaml", "seed-groups-halon.yaml",
                                  "multi-tenant.yaml"])
def test_every_example_policy_validates(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "validate", str(POLICIES / name)]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"{POLICIES / name}: OK (") and "counters" in out


@pytest.mark.parametrize("name", ["seed-suspend-customer1.yaml", "seed-pool-exclusion.yaml"])
def test_the_example_suspension_lists_validate(name: str) -> None:
    assert main(["policy", "validate", "--suspensions", str(POLICIES / name)]) == 0
    assert main(["policy", "validate", str(POLICIES / name)]) == 1  # not a policy


def test_both_spellings_of_the_groups_example_load_the_same() -> None:
    compact = load_policy_file(str(POLICIES / "seed-groups.yaml"))
    halon = load_policy_file(str(POLICIES / "seed-groups-halon.yaml"))
    assert compact.counters == halon.counters


def test_validate_prints_every_problem_with_its_key_path(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "policies:\n"
        "  - fields: [localip, sender, {remotemx: {g: ['/([/']}}]\n"
        "    conditions:\n"
        "      - if: {remotemx: '#nope', recipientdomain: x.com}\n"
        "        then: {concurrency: -1, rate: fast}\n"
        "suspends:\n"
        "  - {}\n"
        "  - {transportid: t, expires_at: 2030-01-01T00:00:00Z, colour: red}\n")
    assert main(["policy", "validate", str(bad)]) == 1
    err = capsys.readouterr().err.splitlines()
    paths = [line.split(": ")[1] for line in err]
    assert paths == [
        "policies[0].conditions[0].if.recipientdomain",
        "policies[0].conditions[0].if.remotemx",
        "policies[0].conditions[0].then.concurrency",
        "policies[0].conditions[0].then.rate",
        "policies[0].fields[1]",
        "policies[0].fields[2].remotemx.g[0]",
        "suspends[0]",
        "suspends[1].colour",
    ]
    assert all(line.startswith(f"{bad}: ") for line in err)


def test_validate_reports_unreadable_files_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "validate", str(tmp_path / "missing.yaml")]) == 1
    assert "no such file" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("[a: b\n")
    assert main(["policy", "validate", str(broken)]) == 1
    assert "invalid YAML at line" in capsys.readouterr().err


def test_show_prints_the_effective_policy_from_the_configuration(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    susp = tmp_path / "suspensions.yaml"
    susp.write_text((POLICIES / "seed-pool-exclusion.yaml").read_text())
    cfg = write_config(tmp_path, scheduler={"policy": str(POLICIES / "seed-groups.yaml"),
                                            "suspensions": str(susp)})
    assert main(["-c", str(cfg), "policy", "show"]) == 0
    out = capsys.readouterr().out
    data = yaml.safe_load(out)
    assert [c["id"] for c in data["policies"]] == ["localip+remotemx", "localip+remotemx+remoteip"]
    assert data["policies"][0]["conditions"][0] == {
        "if": {"remotemx": "#gsuite"}, "then": {"concurrency": 10, "rate": "50/1"}}
    assert data["policies"][0]["default"] == {"concurrency": 5, "rate": "10/1"}
    assert data["suspends"][0]["localip"] == "192.0.2.10"
    # What show prints is itself a valid policy.
    again = tmp_path / "again.yaml"
    again.write_text(out)
    assert main(["policy", "validate", str(again)]) == 0


def test_show_without_a_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path)
    assert main(["-c", str(cfg), "policy", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"policies": [], "suspends": []}
    assert main(["-c", str(cfg), "policy", "show"]) == 0
    assert "no counters" in capsys.readouterr().out


def test_schema_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "counter" in schema["$defs"] and "suspension" in schema["$defs"]


SMALL = """
name: small
seed: 5
policy_file: policy.yaml
scheduler: {max_deliveries: 20, maxmemoryqueue: 200}
destinations:
  named:
    - {domain: gmail.com, mx: alt1.gmail-smtp-in.l.google.com, latency_s: 0.2}
    - {domain: slow.example, latency_s: 3}
traffic:
  - {tenant: acme, localip: [192.0.2.1], messages: 300, rate_per_s: 100}
"""


def test_simulate_prints_tables_and_json(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "policy.yaml").write_text((POLICIES / "seed-groups.yaml").read_text())
    scenario = tmp_path / "small.yaml"
    scenario.write_text(SMALL)
    assert main(["simulate", str(scenario)]) == 0
    out = capsys.readouterr().out
    assert "small: 300 messages, drained" in out
    assert "gmail.com" in out and "slow.example" in out and "acme" in out
    assert main(["simulate", str(scenario), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["delivered"] == 300 and report["drained"] is True
    gmail = next(d for d in report["destinations"] if d["name"] == "gmail.com")
    assert gmail["limit"] == 10  # the #gsuite condition, from one source IP
    assert gmail["peak_concurrency"] <= 10
    assert set(gmail) >= {"throughput_per_s", "wait_p50_s", "wait_p95_s", "wait_p99_s",
                          "drain_s"}


def test_simulate_reports_scenario_errors(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "bad.yaml"
    scenario.write_text("destinations: {named: [{domain: a.example, latency_s: -2}]}\n"
                        "traffic: []\n")
    assert main(["simulate", str(scenario)]) == 1
    err = capsys.readouterr().err
    assert "destinations.named[0].latency_s" in err and "traffic" in err


def test_the_quick_example_scenario_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(SCENARIOS / "quick.yaml"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["drained"] and report["delivered"] + report["bounced"] == 25000


# --------------------------------------------------------------------------
# sluice why, against a real SQLite queue.


def test_why_explains_stored_entries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg_path = write_config(tmp_path)
    config = make_config(tmp_path)
    queue = Queue.open(config)
    try:
        sub = Submission("alice@example.org", ("a@x.example", "b@y.example", "c@z.example"))
        accepted = queue.submit(sub, b"Subject: t\n\nbody\n")
        a, b, c = accepted.qids
        assert main(["-c", str(cfg_path), "why", a]) == 0
        assert "waiting for the next refill" in capsys.readouterr().out
        # b: claimed and failed once -> deferred with the reply.
        claimed = {e.qid: e for e in queue.claim(10)}
        queue.record([AttemptResult(claimed[b], TempFail(Reply(451, "4.7.1", "greylisted")))])
        queue.release_claims([claimed[a], claimed[c]])
        queue.act(Selector(qids=(c,)), Action.HOLD)
    finally:
        queue.close()
    assert main(["-c", str(cfg_path), "why", b]) == 0
    out = capsys.readouterr().out
    assert "deferred until in " in out and '"451 4.7.1 greylisted"' in out
    assert "attempt 1" in out and "expires in" in out
    # Dates, not POSIX seconds: "in 59m59s (at 2026-11-25 08:50:00 UTC)".
    assert re.search(r"deferred until in \S+ \(at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\)", out)
    assert not re.search(r"\(at \d{9,}\)", out)
    assert main(["-c", str(cfg_path), "why", "--json", b]) == 0
    [data] = json.loads(capsys.readouterr().out)
    assert (data["qid"], data["state"], data["source"]) == (b, "deferred", "store")
    assert data["reasons"][0]["kind"] == "deferred" and data["reasons"][0]["until_at"] > 0
    assert data["recipient"] == "b@y.example" and data["attempts"] == 1
    assert data["lines"][0] == f"{b}: deferred"
    assert main(["-c", str(cfg_path), "why", c]) == 0
    assert "on hold" in capsys.readouterr().out
    # A bare SPID explains every recipient of the message.
    assert main(["-c", str(cfg_path), "why", accepted.spid]) == 0
    assert capsys.readouterr().out.count(accepted.spid) == 3
    assert main(["-c", str(cfg_path), "why", f"{accepted.spid}-9"]) == 1
    assert "no entry" in capsys.readouterr().err
    assert main(["-c", str(cfg_path), "why", "not-a-qid"]) == 2


def test_why_says_when_a_deferred_entry_is_due(tmp_path: Path) -> None:
    from sluice.model import QueueEntry, QueueState
    from sluice.retry import RetryPolicy
    from sluice.scheduler import Waiting, explain_stored

    now = time.time()
    entry = QueueEntry("ABCDEF01", 0, "s@x", "r@y", QueueState.DEFERRED, now - 100, now + 600,
                       attempts=2, last_reply=Reply(421, "4.7.0", "slow down"))
    why = explain_stored(entry, now, RetryPolicy())
    assert why.reasons[0].kind is Waiting.DEFERRED and why.expected_at == now + 600
    due = explain_stored(QueueEntry("ABCDEF01", 0, "s@x", "r@y", QueueState.DEFERRED,
                                    now - 100, now - 5), now)
    assert due.expected_at == now and "due now" in due.reasons[0].text
    bounce = explain_stored(QueueEntry("ABCDEF01", 0, "s@x", "r@y", QueueState.BOUNCE,
                                       now - 100, now, last_reply=Reply(550, "5.1.1", "no")),
                            now)
    assert bounce.reasons[0].kind is Waiting.BOUNCE and "NDR" in bounce.reasons[0].text
