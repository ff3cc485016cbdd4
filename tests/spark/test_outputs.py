"""Outputs through Spark and the Hadoop FileSystem API; JVM errors as one line;
the suppression merge and the shaping window held to their references."""

from __future__ import annotations

import random
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from sluice.accounting import EVENT_FIELDS
from sluice.cli import main
from sluice.pipeline.schema import EVENT_SCHEMA
from sluice.pipeline.shape import BUCKET_US, attempts, inflight_marks
from sluice.pipeline.suppress_list import LIST_SCHEMA, merge_lists, read_list
from sluice.suppression import (
    SuppressionEntry,
    SuppressionList,
    SuppressionReason,
    merge_entries,
    write_suppression_list,
)
from tests.spark.frames import event
from tests.spark.test_cli import _run_log

pytestmark = pytest.mark.spark

H, S, M = SuppressionReason.HARD, SuppressionReason.SOFT, SuppressionReason.MANUAL
T = 1_700_000_000.0


def test_every_output_goes_through_hadoop_for_a_uri(spark, tmp_path: Path, capsys,
                                                    monkeypatch) -> None:
    _run_log(tmp_path / "log")
    monkeypatch.chdir(tmp_path)
    out = f"file://{tmp_path}/out"
    assert main(["analytics", "all", "-i", str(tmp_path / "log" / "*.jsonl"), "-o", out,
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert not (tmp_path / "file:").exists()  # nothing written by open() on the URI
    assert "<svg" in (tmp_path / "out" / "report.html").read_text()
    assert yaml.safe_load((tmp_path / "out" / "policy.yaml").read_text()) == []  # no evidence
    assert yaml.safe_load((tmp_path / "out" / "shaping-advice.yaml").read_text()) == {
        "rules": []}
    listed = SuppressionList.load(tmp_path / "out" / "suppression.jsonl")
    assert len(listed) == 6 and all(e.reason is H for e in listed)
    # Tables with a time are partitioned by day.
    assert sorted(p.name for p in (tmp_path / "out" / "outcomes_hourly.parquet").glob("day=*"))
    assert sorted(p.name for p in (tmp_path / "out" / "bounces.parquet").glob("day=*"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_jvm_errors_are_one_line_and_exit_2(spark, tmp_path: Path, capsys) -> None:
    _run_log(tmp_path / "log")
    inputs = str(tmp_path / "log" / "*.jsonl")
    # No HDFS listens there (loopback only); give up at once, not after ten tries.
    spark.conf.set("spark.hadoop.ipc.client.connect.max.retries", "0")
    try:
        status = main(["analytics", "report", "-i", inputs, "-o",
                       f"hdfs://127.0.0.1:{_free_port()}/analytics", "--no-progress"])
    finally:
        spark.conf.unset("spark.hadoop.ipc.client.connect.max.retries")
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert len(err.splitlines()) == 1 and "Connection refused" in err, err
    assert main(["analytics", "report", "-i", inputs, "-o", "s3a://bucket/analytics",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "S3AFileSystem not found" in err, err
    assert "--packages org.apache.hadoop:hadoop-aws" in err  # and what to do about it


def _entries(rng: random.Random, n: int, reasons: tuple[SuppressionReason, ...]
             ) -> list[SuppressionEntry]:
    out = []
    for i in rng.sample(range(40), n):
        last = T + rng.randrange(0, 10) * 3600
        out.append(SuppressionEntry(
            f"a{i}@x.example", rng.choice(reasons), category="bad-mailbox", code=550,
            enhanced="5.1.1", response="no", first_at=last - rng.randrange(0, 3) * 3600,
            last_at=last, count=rng.randrange(1, 4),
            expires_at=None if rng.random() < 0.5 else last + rng.randrange(-5, 30) * 3600))
    return out


def _frame(spark, entries: list[SuppressionEntry]):
    def ts(value: float | None) -> datetime | None:
        return None if value is None else datetime.fromtimestamp(value, UTC)

    return spark.createDataFrame(
        [(e.address, str(e.reason), e.category, e.code, e.enhanced, e.response,
          ts(e.first_at), ts(e.last_at), e.count, ts(e.expires_at)) for e in entries],
        LIST_SCHEMA)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_merge_agrees_with_the_reference(spark, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    old = _entries(rng, 25, (H, S, M))
    new = _entries(rng, 25, (H, S))
    delivered = {f"a{i}@x.example": T + rng.randrange(0, 12) * 3600
                 for i in rng.sample(range(40), 15)}
    now = T + 12 * 3600
    want = merge_entries(old, new, delivered, now)
    path = tmp_path / "list.jsonl"
    write_suppression_list(path, old, generated_at=T)  # read back as Spark reads it
    ok = spark.createDataFrame(
        [(a, datetime.fromtimestamp(t, UTC)) for a, t in delivered.items()],
        "address string, delivered_at timestamp")
    got = merge_lists(read_list(spark, str(path)), _frame(spark, new), ok,
                      datetime.fromtimestamp(now, UTC)).orderBy("address").collect()

    def plain(e: SuppressionEntry) -> tuple[object, ...]:
        return (e.address, str(e.reason), e.first_at, e.last_at, e.count, e.expires_at)

    def row(r) -> tuple[object, ...]:
        def t(v):
            return None if v is None else v.replace(tzinfo=UTC).timestamp() \
                if v.tzinfo is None else v.timestamp()
        return (r.address, r.reason, t(r.first_at), t(r.last_at), r["count"], t(r.expires_at))

    assert [row(r) for r in got] == [plain(e) for e in want]


def test_inflight_counts_cross_minutes_exactly(spark) -> None:
    rng = random.Random(7)
    base = datetime(2026, 11, 20, 10, 0, tzinfo=UTC)
    rows, spans = [], []
    for i in range(300):
        end = base + timedelta(seconds=rng.uniform(0, 400))
        dur = round(rng.uniform(0.5, 150), 3)
        throttled = rng.random() < 0.2
        rows.append(event("deferred" if throttled else "delivered", f"r{i}@gmail.com", 0,
                          time=end, duration_s=dur, remotemx="mx.google.com",
                          code=421 if throttled else 250,
                          enhanced="4.7.0" if throttled else "2.0.0"))
        end_us = int(end.timestamp() * 1_000_000)
        spans.append((end_us - int(dur * 1_000_000), end_us))
    df = spark.createDataFrame([tuple(r[f] for f in EVENT_FIELDS) for r in rows], EVENT_SCHEMA)
    got = inflight_marks(attempts(df)).select("t", "delta", "inflight").collect()
    marks = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running, want = 0, []
    for t, d in marks:
        running += d
        want.append((t, d, running))
    assert sorted((r.t, r.delta, r.inflight) for r in got) == sorted(want)
    assert len({t // BUCKET_US for t, _, _ in want}) > 3  # the marks span several minutes


def test_a_table_by_day_keeps_each_day_apart(spark, tmp_path: Path) -> None:
    # The session writes by day with open writers per task, not after a
    # sort by day (session.DAY_WRITERS_PER_TASK); past that many days in one
    # task Spark sorts the rest.  Seven days, interleaved, in one task.
    from pyspark.sql import functions as F

    from sluice.pipeline.load import write_table
    from sluice.pipeline.session import DAY_WRITERS_PER_TASK

    assert spark.conf.get("spark.sql.optimizer.plannedWrite.enabled") == "false"
    assert spark.conf.get("spark.sql.maxConcurrentOutputFileWriters") == str(
        DAY_WRITERS_PER_TASK)
    days = DAY_WRITERS_PER_TASK + 3
    start = datetime(2026, 11, 1, tzinfo=UTC)
    rows = [(start + timedelta(days=i % days, seconds=i), i) for i in range(700)]
    df = spark.createDataFrame(rows, "time timestamp, n int").coalesce(1)
    write_table(df, str(tmp_path), "t", csv=False, by_day="time")
    back = spark.read.parquet(str(tmp_path / "t.parquet"))
    assert back.count() == 700
    wrong = back.where(F.to_date("time") != F.col("day")).count()
    assert wrong == 0
    per_day = {r["day"].isoformat(): r["count"] for r in back.groupBy("day").count().collect()}
    assert per_day == {(start + timedelta(days=d)).date().isoformat(): 100 for d in range(days)}
