"""Long CLI operations show progress on a terminal, and nothing when piped."""

from __future__ import annotations

import os
import pty
import select
import subprocess
from pathlib import Path

import pytest

from sluice.model import Submission
from sluice.queue import Queue
from tests.conftest import SLUICE, make_config, subprocess_env, write_config

pytestmark = pytest.mark.integration


def _queue(tmp: Path) -> Path:
    cfg = write_config(tmp)
    queue = Queue.open(make_config(tmp))
    try:
        queue.submit(Submission("a@shop.test", tuple(f"u{i}@x.example" for i in range(50))),
                     b"Subject: t\n\nbody\n")
    finally:
        queue.close()
    return cfg


def _on_a_terminal(args: list[str]) -> tuple[int, str]:
    leader, follower = pty.openpty()
    proc = subprocess.Popen(args, stdin=follower, stdout=follower, stderr=follower,
                            env={**subprocess_env(), "TERM": "xterm", "COLUMNS": "100"})
    os.close(follower)
    out = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 30)
        if not ready:
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    return proc.wait(30), out.decode(errors="replace")


def test_bulk_action_shows_a_spinner_only_on_a_terminal(tmp_path: Path) -> None:
    cfg = _queue(tmp_path)
    piped = subprocess.run([SLUICE, "-c", str(cfg), "hold", "--all"], capture_output=True,
                           text=True, env=subprocess_env(), timeout=60)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.strip() == "held 50 recipient(s)"
    assert piped.stderr == ""
    code, shown = _on_a_terminal([SLUICE, "-c", str(cfg), "release", "--all"])
    assert code == 0, shown
    assert "release: changing the selected recipients" in shown
    assert "released 50 recipient(s)" in shown
