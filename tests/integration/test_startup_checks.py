"""What stops `sluice serve` from starting, as an operator meets it.

`sluice config check` makes every check `serve` makes before it binds a
port (sluice.runtime.preflight), so each bad file below is refused by
both, and by the queue commands where the queue is at fault: one line on
stderr naming the file and the key, exit status 2, never a traceback.
Two `serve` on one SMTP port: the second gets "address already in use".
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, SLUICE, subprocess_env
from tests.integration.serving import free_port, start_serve_with, write_serve_config

pytestmark = pytest.mark.integration


def sluice(cfg: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `sluice -c cfg ARGS`; a `serve` that starts after all is stopped and fails."""
    env = {k: v for k, v in subprocess_env().items() if k != "SLUICE_PG_DSN"}
    proc = subprocess.Popen([SLUICE, "-c", str(cfg), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"`sluice {' '.join(args)}` did not stop: {err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_refused(proc: subprocess.CompletedProcess[str], cfg: Path, key: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert str(cfg) in lines[0] and f": {key}" in lines[0], lines[0]


def _bad_cases(tmp: Path) -> dict[str, tuple[dict[str, Any], str]]:
    (tmp / "afile").write_text("a regular file\n")
    (tmp / "junk.pem").write_text("not a certificate\n")
    return {
        "mynetworks": ({"smtpd": {"mynetworks": ["10.0.0.300/8"]}}, "smtpd.mynetworks[0]"),
        "port": ({"smtpd": {"listen": ["127.0.0.1:99999"]}}, "smtpd.listen[0]"),
        "tls-missing": ({"smtpd": {"tls": {"cert": str(tmp / "no.pem"),
                                           "key": str(tmp / "no.key")}}}, "smtpd.tls.cert"),
        "tls-not-pem": ({"smtpd": {"tls": {"cert": str(tmp / "junk.pem"),
                                           "key": str(tmp / "junk.pem")}}}, "smtpd.tls.cert"),
        "policy": ({"scheduler": {"policy": str(tmp / "no-policy.yaml")}}, "scheduler.policy"),
        "hook": ({"smtpd": {"hook": "no_such_module_here:hook"}}, "smtpd.hook"),
        "postgres": ({"queue": {"store": "postgres"}}, "queue.postgres.dsn"),
        "transport": ({"delivery": {"transport": {"example.com": "smtp:[10.0.0.1"}}},
                      "delivery.transport"),
        "queue-in-proc": ({"queue": {"path": "/proc/sluice-queue"}}, "queue.path"),
        "queue-under-file": ({"queue": {"path": str(tmp / "afile" / "queue")}}, "queue.path"),
    }


CASES = ["mynetworks", "port", "tls-missing", "tls-not-pem", "policy", "hook", "postgres",
         "transport", "queue-in-proc", "queue-under-file"]


@pytest.mark.parametrize("case", CASES)
def test_config_check_and_serve_refuse_the_same_file(tmp_path: Path, case: str) -> None:
    sections, key = _bad_cases(tmp_path)[case]
    if case == "postgres":
        pytest.importorskip("psycopg")
    cfg = write_serve_config(tmp_path, free_port(), **sections)
    assert_refused(sluice(cfg, "config", "check"), cfg, key)
    assert_refused(sluice(cfg, "serve"), cfg, key)


@pytest.mark.parametrize("case", ["queue-in-proc", "queue-under-file"])
@pytest.mark.parametrize("command", ["qcount", "qlist"])
def test_queue_commands_name_a_bad_queue_path(tmp_path: Path, case: str, command: str) -> None:
    sections, key = _bad_cases(tmp_path)[case]
    cfg = write_serve_config(tmp_path, free_port(), **sections)
    assert_refused(sluice(cfg, command), cfg, key)


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    cfg = tmp_path / "sluice.yaml"
    cfg.write_text(f"queue:\n  path: {tmp_path / 'q1'}\n"
                   "api:\n  enabled: false\n"
                   f"queue:\n  path: {tmp_path / 'q2'}\n")
    proc = sluice(cfg, "config", "check")
    assert_refused(proc, cfg, "queue")
    assert "line 5" in proc.stderr and "line 1" in proc.stderr
    nested = tmp_path / "nested.yaml"
    nested.write_text("smtpd:\n  processes: 1\n  max_recipients: 10\n  processes: 2\n")
    proc = sluice(nested, "config", "check")
    assert_refused(proc, nested, "smtpd.processes")
    assert "line 4" in proc.stderr and "line 2" in proc.stderr


def test_a_good_file_passes_config_check(tmp_path: Path) -> None:
    cfg = write_serve_config(tmp_path, free_port())
    proc = sluice(cfg, "config", "check")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{cfg}: OK"


def test_a_second_serve_on_the_same_port_gets_address_in_use(tmp_path: Path) -> None:
    port = free_port()
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    # The first runs two receiving processes: they share the port between them.
    first_cfg = write_serve_config(first_dir, port, smtpd={"processes": 2})
    second_cfg = write_serve_config(second_dir, port)  # its own queue, the same port
    first = start_serve_with(first_cfg, first_dir, port)
    try:
        proc = sluice(second_cfg, "serve")
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, proc.stderr
        assert len(lines) == 1, proc.stderr
        assert "address already in use" in lines[0].lower()
        assert f"127.0.0.1:{port}" in lines[0]
        assert first.proc.poll() is None  # the first one is untouched
        assert first.run("qcount").returncode == 0
    finally:
        assert first.stop() == 0
