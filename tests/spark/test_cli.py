"""`sluice analytics ...` end to end on an accounting log written by sluice.accounting."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sluice.accounting import AccountingLog, EventKind, make_event
from sluice.cli import main
from sluice.model import QueueEntry, QueueState, Reply
from sluice.suppression import SuppressionList
from tests.spark.frames import T0

AT = T0.timestamp()


def _run_log(path: Path) -> dict[str, int]:
    """A day of a small platform, as the queue would log it; returns the truth."""
    log = AccountingLog(path, rotate="hourly", node="n1")
    truth = {"received": 0, "delivered": 0, "deferred": 0, "bounced": 0, "expired": 0}
    ok = Reply(250, "2.0.0", "Ok: queued as 1A2B3C4D5E")
    for i in range(60):
        dom = ("gmail.com", "example.org", "example.net")[i % 3]
        rcpt = f"user{i}@{dom}"
        start = AT + 97 * i
        entry = QueueEntry(spid=f"{0xA000 + i:012X}", idx=0, sender="news@shop.test",
                           recipient=rcpt, state=QueueState.INCOMING, arrival_at=start,
                           next_attempt_at=start, tenantid=f"t{i % 2}", jobid="spring",
                           localip=("192.0.2.1",), size=2048)
        mx = {"gmail.com": "gmail-smtp-in.l.google.com"}.get(dom, f"mx.{dom}")
        attempt = {"localip": "192.0.2.1", "remotemx": mx, "remoteip": "203.0.113.7",
                   "duration_s": 0.4}
        events = [make_event(EventKind.RECEIVED, entry, start)]
        truth["received"] += 1
        if i % 10 == 3:
            events.append(make_event(EventKind.BOUNCED, entry, start + 2, attempt=1,
                                     reply=Reply(550, "5.1.1", f"<{rcpt}>: no such user"),
                                     **attempt))
            truth["bounced"] += 1
        elif i % 10 == 7:
            for n in (1, 2):
                events.append(make_event(EventKind.DEFERRED, entry, start + 1800 * n, attempt=n,
                                         reply=Reply(421, "4.7.0", "Try again later"),
                                         **attempt))
                truth["deferred"] += 1
            events.append(make_event(EventKind.EXPIRED, entry, start + 7200, attempt=2))
            truth["expired"] += 1
        else:
            events.append(make_event(EventKind.DELIVERED, entry, start + 5, attempt=1,
                                     reply=ok, **attempt))
            truth["delivered"] += 1
        log.record(events, now=start)
    log.close()
    return truth


@pytest.mark.spark
def test_report_command_totals_match_the_log(spark, tmp_path, capsys):
    truth = _run_log(tmp_path / "log")
    out = tmp_path / "out"
    status = main(["analytics", "report", "--input", str(tmp_path / "log" / "*.jsonl"),
                   "--output", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert f"  delivered: {truth['delivered']}" in printed
    part = next((out / "outcomes_total.csv").glob("part-*.csv"))
    with part.open() as fh:
        row = next(csv.DictReader(fh))
    for key, value in truth.items():
        assert int(row[key]) == value, key
    by_domain = next((out / "outcomes_by_domain.csv").glob("part-*.csv")).read_text()
    assert by_domain.splitlines()[0].startswith("domain,received,delivered")
    page = (out / "report.html").read_text()
    assert f"class=total-delivered>{truth['delivered']}<" in page
    assert "421 4.7.0 Try again later" in page


@pytest.mark.spark
def test_suppress_and_shape_commands_use_the_config(spark, tmp_path, capsys):
    _run_log(tmp_path / "log")
    listed = tmp_path / "etc" / "suppression.jsonl"
    config = tmp_path / "sluice.yaml"
    config.write_text(yaml.safe_dump({
        "suppression": {"path": str(listed), "mode": "reject"},
        "analytics": {"suppress_soft_count": 1, "suppress_soft_days": 30},
    }))
    inputs = str(tmp_path / "log" / "*.jsonl")
    assert main(["-c", str(config), "analytics", "suppress", "-i", inputs,
                 "-o", str(tmp_path / "out"), "--no-progress"]) == 0
    suppressed = SuppressionList.load(listed)
    # 6 hard bounces; with N=1 each expiry is a soft suppression too.
    assert len(suppressed) == 12
    assert suppressed.lookup("user3@gmail.com", now=AT).reason == "hard"
    assert suppressed.lookup("user7@example.org", now=AT).reason == "soft"
    assert main(["analytics", "shape", "-i", inputs, "-o", str(tmp_path / "out"),
                 "--no-progress", "--policy", str(tmp_path / "etc" / "policy.yaml")]) == 0
    # The log's few "421 Try again later", one a half hour at one delivery
    # every 97 s, are no evidence of a limit: the policy goes to the file
    # the config names, and advises nothing (once this gave all three
    # destinations "rate: 1/60").
    text = (tmp_path / "etc" / "policy.yaml").read_text()
    assert text.startswith("# Pickup policy advised by `sluice analytics shape`")
    assert yaml.safe_load(text) == []
    findings = {r["destination"]: r for r in _rows(tmp_path / "out" / "throttle_findings.csv")}
    assert set(findings) == {"gsuite", "example-org", "example-net"}
    assert all(not r["rate_per_min"] for r in findings.values())
    capsys.readouterr()


def _rows(path: Path) -> list[dict[str, str]]:
    import csv

    rows: list[dict[str, str]] = []
    for f in sorted(path.glob("*.csv")) if path.is_dir() else [path]:
        with f.open() as stream:
            rows += csv.DictReader(stream)
    return rows


@pytest.mark.spark
def test_maillog_output_feeds_the_report(spark, tmp_path, capsys):
    from tests.spark.test_maillog import LINES

    (tmp_path / "mail.log").write_text("\n".join(LINES) + "\n")
    assert main(["analytics", "maillog", "-i", str(tmp_path / "mail.log"), "-o",
                 str(tmp_path / "pf"), "--year", "2026", "--no-progress"]) == 0
    assert main(["analytics", "bounces", "-i", str(tmp_path / "pf" / "events.parquet"), "-o",
                 str(tmp_path / "b"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "bad-mailbox (hard): 1" in printed
    assert "no-answer-from-host: 1" in printed


@pytest.mark.unit
def test_bad_arguments_cost_no_jvm(tmp_path, capsys):
    assert main(["analytics", "report", "-i", str(tmp_path / "none*"), "-o",
                 str(tmp_path / "o")]) == 2
    assert "matches nothing" in capsys.readouterr().err
    assert main(["analytics", "report", "-i", "x", "-o", "y", "--since", "soon"]) == 2
    assert "--since" in capsys.readouterr().err


@pytest.mark.unit
def test_without_pyspark_the_command_says_how_to_install_it(tmp_path):
    code = ("import sys; sys.modules['pyspark'] = None\n"
            "from sluice.cli import main\n"
            f"sys.exit(main(['analytics', 'report', '-i', {str(tmp_path)!r}, '-o', 'x']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 1
    assert "pip install 'sluice-mta[analytics]'" in done.stderr
    assert "Traceback" not in done.stderr
    helped = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['pyspark'] = None\n"
         "from sluice.cli import main; sys.exit(main(['analytics', '--help']))"],
        capture_output=True, text=True, timeout=60, check=False)
    assert helped.returncode == 0 and "report" in helped.stdout


@pytest.mark.spark
def test_all_runs_several_jobs_over_one_read(spark, tmp_path, capsys):
    truth = _run_log(tmp_path / "log")
    out = tmp_path / "out"
    assert main(["analytics", "all", "--jobs", "report,bounces", "-i",
                 str(tmp_path / "log" / "*.jsonl"), "-o", str(out), "--no-progress",
                 "--no-html"]) == 0
    printed = capsys.readouterr().out
    assert "sluice analytics report: done" in printed
    assert "sluice analytics bounces: done" in printed
    assert f"bad-mailbox (hard): {truth['bounced']}" in printed
    assert (out / "bounce_summary.csv").is_dir() and (out / "outcomes_total.parquet").is_dir()
    assert not (out / "report.html").exists()
    assert main(["analytics", "all", "--jobs", "report,nonsense", "-i",
                 str(tmp_path / "log" / "*.jsonl"), "-o", str(out)]) == 2


@pytest.mark.spark
def test_progress_bar_draws_each_step(spark):
    import io

    from rich.console import Console

    from sluice.pipeline.progress import SparkProgress

    sink = io.StringIO()
    console = Console(file=sink, force_terminal=True, width=100)
    with SparkProgress(spark, enabled=True, console=console, interval_s=0.05) as progress:
        progress.step("first step")
        spark.range(0, 200_000, numPartitions=6).selectExpr("sum(id)").collect()
        progress.step("second step")
    text = sink.getvalue()
    assert "first step" in text and "second step" in text
    quiet = io.StringIO()
    with SparkProgress(spark, enabled=False, console=Console(file=quiet)) as progress:
        progress.step("hidden")
    assert quiet.getvalue() == ""
