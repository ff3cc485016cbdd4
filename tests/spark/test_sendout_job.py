"""`sluice sendout` end to end: a CSV list through Spark into a real `sluice serve`."""

from __future__ import annotations

import csv
import email
from collections.abc import Iterator
from email import policy
from pathlib import Path

import pytest

from sluice.cli import main
from sluice.suppression import SuppressionEntry, SuppressionReason, write_suppression_list
from tests.integration.serving import wait_until
from tests.integration.test_api_support import ApiServer, api_server

pytestmark = [pytest.mark.spark, pytest.mark.integration, pytest.mark.slow]

TEMPLATE = """\
from: Shop <news@shop.example>
subject: "Hello {{ first }}"
text: |
  Dear {{ first }}, your code is {{ code }}.
html: |
  <p>Dear {{ first }}, your code is <b>{{ code }}</b>.</p>
headers:
  List-Unsubscribe: "<mailto:unsub@shop.example?subject={{ email }}>"
"""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    tmp = tmp_path_factory.mktemp("sendout")
    listed = tmp / "suppression.jsonl"
    write_suppression_list(listed, [SuppressionEntry(
        "gone@list.example", SuppressionReason.HARD, last_at=1.7e9)], generated_at=1.7e9)
    with api_server(tmp, suppression={"path": str(listed)}) as server:
        yield server


def _list(path: Path) -> dict[str, int]:
    rows = [{"email": f"user{i}@d{i % 4}.example", "first": f"U{i}", "code": str(1000 + i)}
            for i in range(30)]
    rows += [{"email": "not an address", "first": "X", "code": "1"},
             {"email": "User3@D3.EXAMPLE", "first": "dup", "code": "2"},
             {"email": "gone@list.example", "first": "G", "code": "3"},
             {"email": "nofirst@d1.example", "first": "", "code": "4"}]
    with path.open("w", newline="") as fh:
        out = csv.DictWriter(fh, fieldnames=["email", "first", "code"])
        out.writeheader()
        out.writerows(rows)
    return {"queued": 30, "invalid": 2, "duplicate": 1, "suppressed": 1}


def test_a_list_is_cleaned_injected_and_sent_once(spark, srv: ApiServer, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    want = _list(tmp_path / "list.csv")
    (tmp_path / "template.yaml").write_text(TEMPLATE)
    args = ["-c", str(srv.serving.config), "sendout", "-i", str(tmp_path / "list.csv"),
            "-t", str(tmp_path / "template.yaml"), "--job", "spring", "--tenant", "shop",
            "--sender", "news@shop.example", "-o", str(tmp_path / "out"), "--no-progress",
            "--batch-size", "7", "--rows-per-task", "10"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    for status, n in want.items():
        assert f"  {status}: {n}" in printed, printed
    outcomes = {r.input: r for r in spark.read.parquet(str(tmp_path / "out" / "outcomes.parquet"))
                .collect()}
    assert len(outcomes) == 34
    assert outcomes["nofirst@d1.example"].reason == "no value for first, which the template needs"
    assert outcomes["User3@D3.EXAMPLE"].status == "duplicate"
    assert outcomes["gone@list.example"].status == "suppressed"
    queued = [r for r in outcomes.values() if r.status == "queued"]
    assert all(r.queue_id and not r.duplicate for r in queued)
    assert wait_until(lambda: srv.sink.snapshot().total_delivered >= 30, 60)
    msg = next(email.message_from_bytes(m.data, policy=policy.default)  # type: ignore[misc]
               for m in srv.sink.messages if m.recipients == ("user7@d3.example",))
    assert msg["Subject"] == "Hello U7"
    assert "your code is 1007" in msg.get_body(("plain",)).get_content()
    page = (tmp_path / "out" / "sendout.html").read_text()
    assert "Sendout spring" in page and "d3.example" in page

    # The same job again: every recipient is answered from the idempotency
    # index with its first queue id, and nothing is queued twice.
    assert main([*args[:-7], "-o", str(tmp_path / "again"), "--no-progress"]) == 0
    capsys.readouterr()
    again = {r.input: r for r in spark.read.parquet(str(tmp_path / "again" / "outcomes.parquet"))
             .collect() if r.status == "queued"}
    assert len(again) == 30 and all(r.duplicate for r in again.values())
    assert {k: r.queue_id for k, r in again.items()} == {r.input: r.queue_id for r in queued}
    assert srv.counts(jobid="spring")["recipients"] == 0 or wait_until(
        lambda: srv.counts(jobid="spring")["recipients"] == 0, 30)
    assert srv.sink.snapshot().total_delivered == 30


def test_a_dry_run_sends_nothing(spark, srv: ApiServer, tmp_path: Path, capsys) -> None:
    _list(tmp_path / "list.csv")
    (tmp_path / "template.yaml").write_text(TEMPLATE)
    before = srv.sink.snapshot().total_delivered
    assert main(["-c", str(srv.serving.config), "sendout", "-i", str(tmp_path / "list.csv"),
                 "-t", str(tmp_path / "template.yaml"), "--job", "dry", "--sender",
                 "news@shop.example", "-o", str(tmp_path / "out"), "--no-progress",
                 "--dry-run"]) == 0
    assert "  ready: 30" in capsys.readouterr().out
    assert srv.counts(jobid="dry")["recipients"] == 0
    assert srv.sink.snapshot().total_delivered == before


def test_operator_mistakes_are_one_line(spark, srv: ApiServer, tmp_path: Path, capsys) -> None:
    _list(tmp_path / "list.csv")
    (tmp_path / "template.yaml").write_text(TEMPLATE.replace("{{ code }}", "{{ coupon }}"))
    base = ["-c", str(srv.serving.config), "sendout", "-i", str(tmp_path / "list.csv"),
            "--job", "bad", "--sender", "news@shop.example", "-o", str(tmp_path / "out"),
            "--no-progress"]
    assert main([*base, "-t", str(tmp_path / "template.yaml")]) == 2
    err = capsys.readouterr().err
    assert "the template needs coupon" in err and "Traceback" not in err
    (tmp_path / "t2.yaml").write_text(TEMPLATE)
    assert main([*base, "-t", str(tmp_path / "t2.yaml"), "--token", "wrong-token-0123456789"]
                ) == 2
    err = capsys.readouterr().err
    assert "HTTP 401" in err and len(err.strip().splitlines()) == 1
