"""Schemathesis against the OpenAPI document a running `sluice serve` serves.

Its generated requests -- valid and invalid, and sequences of them (the
stateful phase) -- must never get a 5xx, and every response must match
the document: status code, content type, headers and body schema.  Every
check runs, "positive_data_acceptance" (ST202) included: a request the
document allows must not be refused with 400 or 422, so the document
states every rule of a request's shape (a non-empty selector, a ttl from
1 s to 366 days, whole numbers); what only the state decides (the running
policy, the server's clock) is a 409, which that check allows.

After the run the queue must still be sound and the server must stop
cleanly.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import subprocess_env
from tests.integration.test_api_support import ALICE, api_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCHEMATHESIS = str(Path(sys.executable).parent / "schemathesis")


def test_the_api_keeps_its_openapi_promises(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text("- fields: [recipientdomain]\n  concurrency: 5\n")
    with api_server(tmp_path, scheduler={"policy": str(tmp_path / "policy.yaml"),
                                         "suspensions": str(tmp_path / "susp.yaml")}) as srv:
        for i in range(5):
            srv.hold(f"s{i}@sender.example", [f"r{i}@fuzz.example", f"r{i}@other.example"])
        srv.ok("POST", "/api/v1/suspensions", json={
            "fields": {"recipientdomain": "paused.example"}, "reason": "so there is one"})
        work = tmp_path / "st"
        work.mkdir()
        proc = subprocess.run(
            [SCHEMATHESIS, "run", f"{srv.url}/api/v1/openapi.json",
             "--header", f"Authorization: Bearer {ALICE}",
             "--checks", "all",
             "--max-examples", "8", "--seed", "20261122", "--workers", "1",
             "--generation-database", "none", "--request-timeout", "20",
             "--report-dir", str(work / "report")],
            capture_output=True, text=True, cwd=work, env=subprocess_env(), timeout=180)
        lines = proc.stdout.splitlines()
        start = next((i for i, line in enumerate(lines) if "ERRORS" in line or "FAILURES" in line),
                     max(0, len(lines) - 60))
        tail = "\n".join(line[:3000] for line in lines[start:])
        assert proc.returncode == 0, f"schemathesis found problems:\n{tail}\n{proc.stderr}"
        operations = sum(len(ops) for ops in
                         srv.ok("GET", "/api/v1/openapi.json")["paths"].values())
        assert re.search(rf"Tested:\s+{operations}\b", proc.stdout), tail
        # Still serving, and nothing it sent broke the server.
        assert srv.call("GET", "/api/v1/health", token=None).json()["status"] == "ok"
        counts = srv.ok("GET", "/api/v1/queue/counts")
        assert counts["recipients"] == sum(counts["by_state"].values())
        crashed = [line for line in srv.serving.output
                   if "Traceback" in line or "failed unexpectedly" in line
                   or "background task failed" in line]
        assert not crashed, "\n".join(srv.serving.output[-80:])
