"""Helpers to run `sluice serve` as a real process in tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sluice._loopback import free_port
from tests.conftest import ROOT, SLUICE, subprocess_env


def run_in_process(srv: Any, sink: Any, body: Callable[[], Awaitable[None]]) -> None:
    """Start an in-process Server, await ``body``, stop the server; then stop the sink's thread.

    ``srv`` is a sluice.runtime.serve.Server and ``sink`` a sluice.sink.Sink
    started with start_in_thread (typed loosely: this module is imported
    by tests that run serve in a child process and need neither).
    """

    async def main() -> None:
        await srv.start()
        try:
            await body()
        finally:
            await asyncio.wait_for(srv.stop(), 30)

    try:
        asyncio.run(main())
    finally:
        sink.stop_thread()


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


@dataclass
class Serving:
    proc: subprocess.Popen[bytes]
    port: int
    config: Path
    dir: Path
    output: list[str]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([SLUICE, "-c", str(self.config), *args], capture_output=True,
                              text=True, env=subprocess_env(), timeout=60, check=True)

    def recipients_left(self) -> int:
        out = self.run("qcount", "--json").stdout
        return int(yaml.safe_load(out)["recipients"])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            if sig == signal.SIGKILL:
                # The whole process group: the manager and its receivers.
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.stdout:
                self.proc.stdout.close()


def write_serve_config(tmp: Path, port: int, **sections: dict[str, Any]) -> Path:
    data: dict[str, dict[str, Any]] = {
        "node": {"hostname": "mx.sluice.test", "id": "test-node"},
        "queue": {"path": str(tmp / "queue"), "spool": {"rootpath": str(tmp / "spool")},
                  "retry_delays": "1s | 2s"},
        "accounting": {"path": str(tmp / "log")},
        "smtpd": {"listen": [f"127.0.0.1:{port}"], "processes": 1},
        "api": {"enabled": False},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    path = tmp / "sluice.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def start_serve(tmp: Path, **sections: dict[str, Any]) -> Serving:
    port = free_port()
    config = write_serve_config(tmp, port, **sections)
    return start_serve_with(config, tmp, port)


def _drain(proc: subprocess.Popen[bytes], output: list[str]) -> None:
    stream = proc.stdout
    if stream is None:
        return
    with contextlib.suppress(ValueError, OSError):
        for line in stream:
            output.append(line.decode(errors="replace").rstrip("\n"))


def start_serve_with(config: Path, tmp: Path, port: int, timeout: float = 60,
                     wrapper: tuple[str, ...] = ()) -> Serving:
    """Starts `sluice serve`; ``wrapper``, if given, is a command that execs its arguments."""
    proc = subprocess.Popen(
        [*wrapper, SLUICE, "-c", str(config), "serve", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=subprocess_env(),
        start_new_session=True)
    assert proc.stdout is not None
    output: list[str] = []
    deadline = time.monotonic() + timeout
    buf = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            output += [line.decode(errors="replace") for line in lines]
            if any("serving SMTP on" in line for line in output):
                # Keep reading its output so a chatty server never blocks on a full pipe.
                threading.Thread(target=_drain, args=(proc, output), daemon=True).start()
                return Serving(proc, port, config, tmp, output)
        if proc.poll() is not None:
            break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # Closed here: left to the garbage collector, the pipe's ResourceWarning
    # fails whichever later test is running when it is collected.
    proc.stdout.close()
    raise AssertionError("sluice serve did not start:\n" + "\n".join(output)
                         + buf.decode(errors="replace"))


@contextlib.contextmanager
def serving(tmp: Path, **sections: dict[str, Any]) -> Iterator[Serving]:
    s = start_serve(tmp, **sections)
    try:
        yield s
    finally:
        code = s.stop()
        assert code == 0, f"sluice serve exited with {code}"
