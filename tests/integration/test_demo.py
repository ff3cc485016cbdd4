"""`sluice demo` runs the whole flow and ends with what it promises."""

from __future__ import annotations

import importlib.util
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sluice.runtime.demo import plan_domains
from tests.conftest import SLUICE, subprocess_env

pytestmark = pytest.mark.integration


def test_domain_plan_has_every_behaviour() -> None:
    plan = plan_domains(50, random.Random(1))
    assert len(plan.behaviours) == 50
    assert (len(plan.of("greylist")), len(plan.of("reject")), len(plan.of("slow")),
            len(plan.of("tempfail"))) == (8, 4, 2, 1)
    assert len(plan.of("accept")) == 35


def test_demo_delivers_greylisted_mail_and_bounces_rejected_mail() -> None:
    proc = subprocess.run([SLUICE, "demo", "--messages", "200", "--domains", "20"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "Done in" in out
    assert "qshape" in out and "TOTAL" in out
    summary = out[out.index("Done in"):].replace("\n", " ")
    assert "200 messages accepted" in summary
    assert "rejected and answered with" in summary
    if importlib.util.find_spec("pyspark") is None:
        assert "No Spark report: the analytics extra" in out
        return
    # It ends with the Spark report over its own accounting log: the hard
    # bounces Spark classed are the recipients the sink rejected.
    rejected = int(re.search(r"(\d+) rejected and answered", summary)[1])  # type: ignore[index]
    page = Path(re.search(r"Spark report in [\d.]+ s: (\S+report\.html)", out.replace("\n", ""))[1])  # type: ignore[index]
    try:
        assert "<svg" in page.read_text()
        assert re.search(rf"bounced\s*│\s*bad-mailbox\s*│\s*yes\s*│\s*{rejected}\s", out), out
        assert "per domain" in out and "d01.demo.example" in out
    finally:
        shutil.rmtree(page.parent, ignore_errors=True)


@pytest.mark.slow
def test_the_cluster_demo_holds_its_limit_across_two_nodes() -> None:
    out = subprocess.run([SLUICE, "demo", "--nodes", "2", "--messages", "90", "--timeout", "90"],
                         capture_output=True, text=True, timeout=240, env=subprocess_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    m = re.search(r"(\d+) of (\d+) messages delivered; peak (\d+) connections", out.stdout)
    assert m and m.group(1) == m.group(2) == "90", out.stdout[-1500:]
    assert int(m.group(3)) <= 3
    assert "n1" in out.stdout and "Redis: reachable" in out.stdout
