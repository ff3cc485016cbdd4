"""The jobs on a real Spark cluster: a standalone master and one worker on loopback.

Both are started from the installed pyspark's ``bin/spark-class`` (the
entry points Spark's own start scripts use), on free loopback ports, in a
temporary work directory.  ``sluice analytics all`` and ``sluice sendout``
run against ``spark://127.0.0.1:PORT`` in a child process (this process
already holds the suite's local session) and their results must equal
those of the same commands on the suite's local session: the same tables,
the same suppression list and policy, the same per-recipient outcomes.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.cli import main
from sluice.suppression import SuppressionList
from tests.conftest import subprocess_env
from tests.integration.test_api_support import ApiServer, api_server
from tests.spark.test_cli import _run_log
from tests.spark.test_sendout_job import TEMPLATE
from tests.spark.test_sendout_job import _list as _recipients

pytestmark = [pytest.mark.spark, pytest.mark.integration, pytest.mark.slow]

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spark_class() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent / "bin" / "spark-class"


def _env(work: Path) -> dict[str, str]:
    import pyspark

    return subprocess_env(
        SPARK_HOME=str(Path(pyspark.__file__).parent), SPARK_LOCAL_IP="127.0.0.1",
        SPARK_CONF_DIR=str(HERE), SPARK_LOG_DIR=str(work), SPARK_WORKER_DIR=str(work / "w"),
        PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)


def _alive_workers(ui: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=2) as r:
            return int(json.load(r).get("aliveworkers", 0))
    except OSError:
        return 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    spark_class = _spark_class()
    if not spark_class.exists():
        pytest.skip(f"{spark_class}: the installed pyspark has no spark-class")
    work = tmp_path_factory.mktemp("cluster")
    env = _env(work)
    port, ui, wui = _free_port(), _free_port(), _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for name, args in (
            ("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                        "--port", str(port), "--webui-port", str(ui)]),
            ("worker", ["org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}",
                        "--host", "127.0.0.1", "--cores", "2", "--memory", "1g",
                        "--webui-port", str(wui), "--work-dir", str(work / "w")]),
        ):
            log = (work / f"{name}.log").open("wb")
            logs.append(log)
            procs.append(subprocess.Popen([str(spark_class), *args], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 90
        while _alive_workers(ui) < 1:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                text = "\n".join((work / f"{n}.log").read_text()[-2000:]
                                 for n in ("master", "worker"))
                raise AssertionError(f"the standalone cluster did not come up:\n{text}")
            time.sleep(0.5)  # waiting for real JVMs, not timing anything
        yield f"spark://127.0.0.1:{port}"
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


def _on_cluster(master: str, args: list[str], work: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "sluice", *args, "--master", master, "--no-progress",
         "--driver-memory", "1g"],
        capture_output=True, text=True, cwd=work, env=_env(work), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _table(spark, path: Path) -> list[tuple[object, ...]]:
    df = spark.read.parquet(str(path))
    return sorted((tuple(r) for r in df.select(*sorted(df.columns)).collect()), key=repr)


def test_analytics_all_on_a_cluster_equals_local(spark, cluster: str, tmp_path: Path,
                                                 capsys) -> None:
    _run_log(tmp_path / "log")
    inputs = str(tmp_path / "log" / "*.jsonl")
    assert main(["analytics", "all", "-i", inputs, "-o", str(tmp_path / "local"),
                 "--no-progress"]) == 0
    capsys.readouterr()
    _on_cluster(cluster, ["analytics", "all", "-i", inputs, "-o", str(tmp_path / "cl")],
                tmp_path)
    for table in ("outcomes_total", "outcomes_by_domain", "outcomes_hourly", "reasons_top",
                  "bounces", "bounce_summary", "suppression", "throttle_findings"):
        local = _table(spark, tmp_path / "local" / f"{table}.parquet")
        assert local, table
        assert _table(spark, tmp_path / "cl" / f"{table}.parquet") == local, table
    entries = [e.address for e in SuppressionList.load(tmp_path / "local" / "suppression.jsonl")]
    assert entries and entries == [
        e.address for e in SuppressionList.load(tmp_path / "cl" / "suppression.jsonl")]

    def policy(out: str) -> list[str]:  # (the comment names the time it was made)
        text = (tmp_path / out / "policy.yaml").read_text()
        return [line for line in text.splitlines() if not line.startswith("#")]

    assert policy("cl") == policy("local") and policy("local")
    assert "<svg" in (tmp_path / "cl" / "report.html").read_text()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    with api_server(tmp_path_factory.mktemp("cluster-sendout")) as server:
        yield server


def test_sendout_on_a_cluster_equals_local(spark, cluster: str, srv: ApiServer, tmp_path: Path,
                                           capsys) -> None:
    want = _recipients(tmp_path / "list.csv")
    (tmp_path / "template.yaml").write_text(TEMPLATE)

    def args(job: str, out: str) -> list[str]:
        return ["-c", str(srv.serving.config), "sendout", "-i", str(tmp_path / "list.csv"),
                "-t", str(tmp_path / "template.yaml"), "--job", job, "--sender",
                "news@shop.example", "-o", str(tmp_path / out), "--batch-size", "5",
                "--rows-per-task", "8"]

    assert main([*args("local", "local"), "--no-progress"]) == 0
    capsys.readouterr()
    printed = _on_cluster(cluster, args("cluster", "cl"), tmp_path)
    # Nothing is suppressed here (this server has no list): the gone address is queued.
    want["queued"] += want.pop("suppressed")
    for status, n in want.items():
        assert f"  {status}: {n}" in printed, printed

    def outcomes(out: str) -> dict[str, tuple[object, ...]]:
        rows = spark.read.parquet(str(tmp_path / out / "outcomes.parquet")).collect()
        return {r.input: (r.status, r.reason, bool(r.queue_id), r.duplicate) for r in rows}

    local = outcomes("local")
    assert len(local) == 34 and outcomes("cl") == local
