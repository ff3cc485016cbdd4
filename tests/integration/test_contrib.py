"""contrib/: the Grafana dashboard and the Prometheus alert rules name only
metrics a running Sluice exposes, and the rules pass promtool."""

from __future__ import annotations

import json
import re
import shutil
import smtplib
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT
from tests.integration.serving import wait_until
from tests.integration.test_api_support import api_server

pytestmark = pytest.mark.integration

CONTRIB = ROOT / "contrib"
RULES = CONTRIB / "prometheus" / "sluice-alerts.yml"
DASHBOARD = CONTRIB / "grafana" / "sluice-dashboard.json"
METRIC = re.compile(r"\b(sluice_[a-z_]+)\b")


def dashboard_exprs() -> list[str]:
    data = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in data["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in data["templating"]["list"] if v.get("definition")]
    return exprs


def rule_exprs() -> list[str]:
    data = yaml.safe_load(RULES.read_text())
    return [r["expr"] for g in data["groups"] for r in g["rules"]]


def test_dashboard_and_rules_name_only_metrics_that_exist(tmp_path: Path) -> None:
    with api_server(tmp_path) as srv:
        with smtplib.SMTP("127.0.0.1", srv.serving.port, local_hostname="client.test") as c:
            c.sendmail("s@sender.example", ["u@a.example"], b"Subject: m\r\n\r\nbody\r\n")
        assert wait_until(lambda: "sluice_recipients_total{" in srv.call("GET", "/metrics")
                          .text, 30)
        text = srv.call("GET", "/metrics").text
    names: set[str] = set()
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        for sample in family.samples:
            names.add(sample.name)
            samples.setdefault(sample.name, []).append(dict(sample.labels))
    used = {m for e in dashboard_exprs() + rule_exprs() for m in METRIC.findall(e)}
    assert len(used) >= 10
    assert not used - names, f"named but not exposed: {sorted(used - names)}"
    # Error counters are there at zero before the first error, so rate() works.
    ops = {lab["op"] for lab in samples.get("sluice_store_write_errors_total", [])}
    assert {"submit", "apply", "claim"} <= ops


def test_dashboard_is_grafana_json_with_unique_panels() -> None:
    data = json.loads(DASHBOARD.read_text())
    assert data["uid"] and data["title"] and data["schemaVersion"] >= 30
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids))
    for panel in data["panels"]:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (Debian package prometheus, scripts/setup)")
def test_alert_rules_pass_promtool() -> None:
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 7 rules found" in check.stdout
    unit = subprocess.run(["promtool", "test", "rules", "sluice-alerts-test.yml"],
                          cwd=RULES.parent, capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0, unit.stdout + unit.stderr
