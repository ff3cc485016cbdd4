"""Every background part of `sluice serve` killed by an injected exception.

A real Server (and, for the exit status, a real `sluice serve` process)
with a real store in a temp dir; the exception is injected by replacing
the part's coroutine for its first run.  A part that can restart (the
change-feed watcher, the expiry sweep, the policy file watcher, the new-
mail poller, the API's HTTP server and metrics follower) must be logged
once with its cause, started again after its back-off, and work again; a
part that cannot (the scheduler loop, the work it starts) must stop the
whole server -- receivers, API, queue, lock -- with PartFailed, and `sluice
serve` with one line and exit status 1.  Back-offs are made short through
Health; nothing waits on a long sleep.
"""

from __future__ import annotations

import asyncio
import logging
import smtplib
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.api.server import ApiServer
from sluice.config import Config
from sluice.runtime.duties import ChangeWatcher, ExpirySweep
from sluice.runtime.manager import QueueManager
from sluice.runtime.parts import Backoff, Health, PartFailed
from sluice.runtime.policy_file import PolicyFile
from sluice.runtime.refill import Refiller
from sluice.runtime.serve import Server
from tests.conftest import ROOT, make_config, subprocess_env, write_config
from tests.integration.serving import free_port

pytestmark = pytest.mark.integration

TOKEN = "parts-token-0123456789abcdef"
FAST = {"change_poll_s": 0.05, "policy_poll_s": 0.05}


def config(tmp: Path, store: str = "kv", api: bool = False) -> Config:
    policy = tmp / "policy.yaml"
    policy.write_text("- fields: [recipientdomain]\n  concurrency: 5\n")
    return make_config(
        tmp,
        queue={"store": store, "bounces_interval": "1s"},
        smtpd={"listen": [f"127.0.0.1:{free_port()}"], "processes": 1},
        scheduler={"policy": str(policy)},
        api={"enabled": api, "listen": f"127.0.0.1:{free_port()}", "tokens": {"t": TOKEN}},
        delivery={"transport": {"*": f"smtp:[127.0.0.1]:{free_port()}"}})


def server(cfg: Config) -> Server:
    return Server(cfg, poll_s=0.05, health=Health(backoff=Backoff(first_s=0.01, max_s=0.05)),
                  manager_options=FAST)


class Crash:
    """A part's coroutine that fails on its first run, then is the real one."""

    def __init__(self, real: Callable[..., Any], name: str) -> None:
        self.real = real
        self.message = f"injected into the {name}"
        self.runs = 0
        self.restarted = asyncio.Event()

    def __call__(self, *args: Any) -> Any:
        self.runs += 1
        if self.runs == 1:
            async def fail() -> None:
                await asyncio.sleep(0)
                raise RuntimeError(self.message)
            return fail()
        self.restarted.set()
        return self.real(*args)


RESTARTABLE = [
    # (part name in the logs, class, attribute, store, api)
    ("change feed watcher", ChangeWatcher, "run", "kv", False),
    ("expiry sweep", ExpirySweep, "run", "kv", False),
    ("policy file watcher", PolicyFile, "watch", "kv", False),
    ("new-mail poller", Server, "_poll", "sqlite", False),
    ("API server", ApiServer, "serve", "kv", True),
    ("API metrics follower", ApiServer, "follow", "kv", True),
]


@pytest.mark.parametrize(("part", "cls", "attr", "store", "api"), RESTARTABLE,
                         ids=[p[0].replace(" ", "-") for p in RESTARTABLE])
def test_a_part_that_crashes_is_logged_once_and_restarted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        part: str, cls: type, attr: str, store: str, api: bool) -> None:
    caplog.set_level(logging.INFO)
    crash = Crash(getattr(cls, attr), part)

    def patched(*args: Any) -> Any:  # a function, so that it binds as a method
        return crash(*args)

    monkeypatch.setattr(cls, attr, patched)
    cfg = config(tmp_path, store, api)

    async def main() -> None:
        srv = server(cfg)
        await srv.start()
        try:
            await asyncio.wait_for(crash.restarted.wait(), 10)
            trouble = srv.health.part(part)
            for _ in range(500):  # the restarted part reports that it works
                if not trouble.failing:
                    break
                await asyncio.sleep(0.01)
            assert not trouble.failing and trouble.errors_total == 1
            # The server still does its work: mail in, and (with the API) answers.
            host, port = srv.addresses[0]
            await asyncio.to_thread(_send, host, port)
            if api:
                async with httpx.AsyncClient() as client:
                    r = await client.get(f"http://{cfg.api.listen}/api/v1/scheduler/stats",
                                         headers={"Authorization": f"Bearer {TOKEN}"})
                    assert r.status_code == 200
        finally:
            await srv.stop()

    asyncio.run(main())
    assert crash.runs == 2
    failures = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(failures) == 1, [r.getMessage() for r in failures]
    (failure,) = failures
    assert part in failure.getMessage() and crash.message in failure.getMessage()
    assert failure.exc_info is not None  # a bug: its traceback, once
    again = [r.getMessage() for r in caplog.records if "works again" in r.getMessage()]
    assert again == [f"{part} works again after 1 failures in 0 s"]


def _send(host: str, port: int) -> None:
    with smtplib.SMTP(host, port, local_hostname="client.test", timeout=10) as c:
        c.sendmail("a@sender.example", ["b@rcpt.example"], b"Subject: t\r\n\r\nbody\r\n")


VITAL = [
    ("the scheduler loop", QueueManager, "_step"),
    ("a refill (work the loop started)", Refiller, "refill"),
]


@pytest.mark.parametrize(("what", "cls", "attr"), VITAL, ids=["loop", "refill"])
def test_a_crash_of_the_queue_manager_stops_the_whole_server(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        what: str, cls: type, attr: str) -> None:
    caplog.set_level(logging.INFO)
    real = getattr(cls, attr)
    calls = 0
    boom = RuntimeError(f"injected into {what}")

    def crashing(self: Any, *args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            if attr == "refill":
                async def fail() -> None:
                    raise boom
                for arg in args:
                    del arg
                return fail()
            raise boom
        return real(self, *args)

    monkeypatch.setattr(cls, attr, crashing)
    cfg = config(tmp_path, "kv", api=True)
    srv = server(cfg)

    async def main() -> None:
        await srv.start()
        host, port = srv.addresses[0]
        for _ in range(3):  # mail makes the loop step and refill, until it fails
            try:
                await asyncio.to_thread(_send, host, port)
            except (smtplib.SMTPException, OSError):
                break
        with pytest.raises(PartFailed) as failed:
            await asyncio.wait_for(srv.wait(), 20)
        assert failed.value.part == "queue manager" and failed.value.cause is boom

    asyncio.run(main())
    # Everything was stopped: the lock is free, the SMTP and API ports are closed.
    again = Server(cfg)
    again._lock()
    assert again._lock_fd >= 0
    with pytest.raises(OSError):
        _send(*srv.addresses[0])
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{cfg.api.listen}/api/v1/health")
    failures = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in failures] == [
        f"queue manager failed: RuntimeError: injected into {what}"]


SERVE_WITH_A_FAULT = textwrap.dedent('''
    """`sluice serve` with a fault injected into the scheduler loop after start."""
    import sys
    from sluice.cli import main
    from sluice.runtime.manager import QueueManager

    real = QueueManager._step
    calls = 0

    def step(self):
        global calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected into the loop")
        return real(self)

    if __name__ == "__main__":  # receivers are started with spawn: they import this
        QueueManager._step = step
        sys.exit(main(["-c", sys.argv[1], "serve", "--log-level", "warning"]))
''')


def test_sluice_serve_stops_with_one_line_and_exit_status_1(tmp_path: Path) -> None:
    cfg = config(tmp_path, "sqlite")
    path = write_config(tmp_path, **{k: v for k, v in cfg.to_dict(readable=True).items()
                                     if isinstance(v, dict)})
    script = tmp_path / "faulty_serve.py"
    script.write_text(SERVE_WITH_A_FAULT)
    proc = subprocess.run([sys.executable, str(script), str(path)], capture_output=True,
                          text=True, cwd=ROOT, env=subprocess_env(), timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == ("sluice: serve stopped: queue manager failed: RuntimeError: "
                         "injected into the loop")
    assert proc.stderr.count("Traceback") == 1  # the cause, logged once
    assert "serving SMTP on" in proc.stdout + proc.stderr  # the start-up line, logged
