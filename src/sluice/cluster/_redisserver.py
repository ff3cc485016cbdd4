"""A throwaway Redis server on loopback, for the tests, the demo and the benchmark.

SUMMARY
    RedisServer.start(base=None, port=None) -> RedisServer; server.url;
    server.stop(); server.restart(); find_redis() -> str | None.

DESCRIPTION
    Runs Debian's ``redis-server`` on 127.0.0.1 and a free port (or the one
    given, so that a restart comes back where the nodes look), with its
    working directory in a fresh temporary directory and no persistence:
    the cluster's limits are leases and dates that their holders renew, so
    a Redis that restarts empty is a Redis the nodes fill again.

LIMITATIONS
    For tests, the demo and benchmarks: an operator runs their own Redis.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from sluice._loopback import free_port

__all__ = ["RedisServer", "RedisServerError", "find_redis"]


class RedisServerError(RuntimeError):
    """The throwaway server could not be started."""


def find_redis() -> str | None:
    """The redis-server binary, or None."""
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)


class RedisServer:
    """One redis-server process on loopback."""

    def __init__(self, base: Path, port: int, binary: str, owns_base: bool) -> None:
        self.base = base
        self.port = port
        self.binary = binary
        self.owns_base = owns_base
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls, base: str | os.PathLike[str] | None = None, *,
              port: int | None = None) -> RedisServer:
        binary = find_redis()
        if binary is None:
            raise RedisServerError("redis-server not found (Debian package redis-server; "
                                   "scripts/setup installs it)")
        owns = base is None
        path = Path(tempfile.mkdtemp(prefix="sluice-redis-")) if base is None else Path(base)
        path.mkdir(parents=True, exist_ok=True)
        server = cls(path, port or free_port(), binary, owns)
        server.run()
        return server

    def run(self) -> None:
        """Start the process and wait until it answers."""
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.base), "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning",
                "--logfile", str(self.base / "redis.log")]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.base / "redis.log").read_text(errors="replace")[-500:]
                raise RedisServerError(f"redis-server exited: {log.strip()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.kill()
        raise RedisServerError(f"redis-server did not answer on port {self.port} in 10 s")

    def kill(self) -> None:
        """Stop at once (SIGKILL): what a crash looks like to the nodes."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Come back empty on the same port."""
        self.kill()
        self.run()

    def stop(self) -> None:
        self.kill()
        if self.owns_base:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
