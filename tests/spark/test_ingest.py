"""`sluice analytics ingest`: a Parquet table by day, appended once, that reports read."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from sluice.cli import main
from sluice.pipeline.rules import FAILURE_EVENTS, MASK_RULES_ID, mask
from sluice.pipeline.schema import STORED_MASK, STORED_RULES
from tests.spark.test_cli import _run_log

pytestmark = pytest.mark.spark


def _table(spark, path: Path) -> list[tuple[object, ...]]:
    df = spark.read.parquet(str(path))
    return sorted((tuple(r) for r in df.select(*sorted(df.columns)).collect()), key=repr)


def test_ingest_is_idempotent_and_reports_read_the_table(spark, tmp_path: Path,
                                                         capsys) -> None:
    truth = _run_log(tmp_path / "log")
    files = sorted((tmp_path / "log").glob("*.jsonl"))
    assert len(files) >= 2
    table = tmp_path / "events"
    # First the older hour and half of the newer (a file still growing), then
    # all of it, then all again: the second run adds only the lines written
    # since, the third adds nothing.
    (tmp_path / "first").mkdir()
    shutil.copy(files[0], tmp_path / "first" / files[0].name)
    half = files[-1].read_text().splitlines(keepends=True)
    (tmp_path / "first" / files[-1].name).write_text("".join(half[:len(half) // 2]))
    counts = []
    for source in ("first", "log", "log"):
        assert main(["analytics", "ingest", "-i", str(tmp_path / source / "*.jsonl"),
                     "-o", str(table), "--no-progress"]) == 0
        printed = capsys.readouterr().out
        counts.append(int(printed.split("events_added: ")[1].split()[0]))
    total = spark.read.parquet(str(table)).count()
    lines = sum(len(f.read_text().splitlines()) for f in files)
    assert counts[0] > 0 and counts[0] + counts[1] == lines == total and counts[2] == 0
    assert sorted(p.name for p in table.glob("day=*"))  # partitioned by day
    # Each failure's reply is stored masked, by the rules of this version.
    stored = spark.read.parquet(str(table)).where(F.col("event").isin(*FAILURE_EVENTS))
    pairs = stored.select("response", STORED_MASK, STORED_RULES).collect()
    assert pairs and all(r[1] == mask(r[0]) and r[2] == MASK_RULES_ID for r in pairs)

    # A report over the table equals the report over the JSON lines.
    assert main(["analytics", "all", "-i", str(table), "-o", str(tmp_path / "t"),
                 "--jobs", "report,bounces", "--no-progress"]) == 0
    assert main(["analytics", "all", "-i", str(tmp_path / "log" / "*.jsonl"),
                 "-o", str(tmp_path / "j"), "--jobs", "report,bounces", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"delivered: {truth['delivered']}" in printed
    # Over Parquet, run_jobs caches only the masked failures and the report
    # reads the table again: every table must still be the same.
    for name in ("outcomes_hourly", "outcomes_by_hour", "outcomes_total", "outcomes_by_domain",
                 "reasons_top", "reasons_by_domain", "clients", "bounces", "bounce_summary"):
        assert _table(spark, tmp_path / "t" / f"{name}.parquet") == \
            _table(spark, tmp_path / "j" / f"{name}.parquet"), name


def test_ingest_of_nothing_leaves_a_table_the_next_ingest_appends_to(spark, tmp_path: Path,
                                                                     capsys) -> None:
    # Nothing to add writes no data file, but the table's directory is made:
    # the next ingest must read it as empty, not fail to infer its schema.
    (tmp_path / "empty.jsonl").write_text("")
    table = tmp_path / "events"
    line = ('{"time": "2026-11-20T10:00:00.000Z", "event": "bounced", "recipient": '
            '"bob@example.com", "code": 550, "enhanced": "5.1.1", '
            '"response": "<bob@example.com>: user unknown"}\n')
    (tmp_path / "one.jsonl").write_text(line)
    added = []
    for name in ("empty.jsonl", "one.jsonl"):
        assert main(["analytics", "ingest", "-i", str(tmp_path / name), "-o", str(table),
                     "--no-progress"]) == 0
        added.append(int(capsys.readouterr().out.split("events_added: ")[1].split()[0]))
    assert added == [0, 1]
    row = spark.read.parquet(str(table)).collect()[0]
    assert row[STORED_MASK] == "<addr>: user unknown" and row[STORED_RULES] == MASK_RULES_ID
