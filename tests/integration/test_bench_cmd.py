"""`sluice bench` as an operator runs it: a real process, real disks, a real
PostgreSQL server (its own throwaway one, or $SLUICE_PG_DSN)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import SLUICE, subprocess_env
from tests.integration.pg import external_dsn

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    extra = {"SLUICE_PG_DSN": dsn} if (dsn := external_dsn()) else {}
    return subprocess.run([SLUICE, "bench", *args], capture_output=True, text=True,
                          env=subprocess_env(**extra), timeout=600)


def test_bench_runs_the_balanced_workload_on_every_flavour() -> None:
    proc = bench("--store", "all", "--messages", "60", "--submitters", "4",
                 "--recipients", "3", "--defer-percent", "50", "--json")
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    assert [r["store"] for r in results] == ["sqlite", "fs", "postgres", "kv"]
    for r in results:
        assert r["skipped"] is None, r
        # Every recipient went through claim, half the messages were retried,
        # one tenant in ten was deleted by the operator, the rest delivered.
        assert r["ops"] == {"submit": 60, "defer": 180, "retry": 90, "deliver": 162,
                            "delete": 18}, r
        assert all(v > 0 for v in r["ops_per_s"].values()), r
        assert r["submit_p99_ms"] > 0
        assert 4096 <= r["bytes_per_message"] < 64 * 1024, r


def test_bench_prints_a_table_with_a_progress_bar() -> None:
    proc = bench("--store", "kv", "--messages", "30", "--submitters", "2")
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if "submit/s" in line)
    for column in ("store", "submit/s", "defer/s", "retry/s", "deliver/s", "delete/s",
                   "submit p99", "bytes/msg"):
        assert column in header
    row = next(line for line in proc.stdout.splitlines() if line.startswith("│ kv"))
    assert " ms " in row
    assert "kv: submit" in proc.stderr and "30/30" in proc.stderr


def test_bench_refuses_nonsense() -> None:
    proc = bench("--messages", "0")
    assert proc.returncode == 2
    assert "at least 1" in proc.stderr
    assert "Traceback" not in proc.stderr
