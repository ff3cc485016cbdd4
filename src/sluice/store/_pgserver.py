"""A throwaway PostgreSQL server on loopback, for the tests and ``sluice bench``.

SUMMARY
    PgServer.start(base=None, port=None) -> PgServer; server.dsn;
    server.stop().  find_bindir() -> Path | None.

DESCRIPTION
    Runs initdb into a fresh directory and starts the server with pg_ctl on
    127.0.0.1 and a free port, with trust authentication for the superuser
    ``sluice`` and fsync on (the benchmark measures durable commits).  The
    binaries are found in /usr/lib/postgresql/<version>/bin (Debian's
    packages; the highest version wins), then on PATH, or in
    $SLUICE_PG_BINDIR.

    PostgreSQL refuses to run as root.  When we are root, the data
    directory is given to the ``postgres`` system user that Debian's
    package creates, and initdb and pg_ctl run as that user.

    stop() stops the server at once (``-m immediate``: its data is
    thrown away) and removes the directory.

LIMITATIONS
    For tests and benchmarks only: nothing here is meant to keep data.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from sluice._loopback import free_port

__all__ = ["PgServer", "PgServerError", "find_bindir"]

SUPERUSER = "sluice"


class PgServerError(RuntimeError):
    """The throwaway server could not be set up or started."""


def find_bindir() -> Path | None:
    """Where initdb, pg_ctl and postgres are, or None."""
    env = os.environ.get("SLUICE_PG_BINDIR")
    if env and (Path(env) / "initdb").exists():
        return Path(env)

    def version(p: Path) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in p.parent.name.split("."))
        except ValueError:
            return (0,)

    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    for bindir in candidates:
        if (bindir / "initdb").exists() and (bindir / "pg_ctl").exists():
            return bindir
    found = shutil.which("initdb")
    return Path(found).parent if found else None


class PgServer:
    """A running throwaway server; see the module doc."""

    def __init__(self, base: Path, data: Path, port: int, bindir: Path,
                 user: str | None, log: Path | None = None) -> None:
        self.base = base
        self.data = data
        self.log = log or data / "server.log"
        self.port = port
        self.bindir = bindir
        self.user = user
        self.dsn = f"host=127.0.0.1 port={port} user={SUPERUSER} dbname=postgres"

    @classmethod
    def start(cls, base: str | os.PathLike[str] | None = None, *, port: int | None = None,
              options: Sequence[str] = (), log: Path | None = None) -> PgServer:
        """Make and start a server (initdb, pg_ctl start).

        ``options`` are extra ``-c name=value`` settings; ``log`` is the
        server's log file (data/server.log unless given).
        """
        bindir = find_bindir()
        if bindir is None:
            raise PgServerError(
                "PostgreSQL's server binaries were not found (install the postgresql "
                "package, or set SLUICE_PG_BINDIR, or give SLUICE_PG_DSN)")
        user: str | None = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                raise PgServerError("running as root and there is no 'postgres' user to run "
                                    "the server as") from None
            user = "postgres"
        root = Path(tempfile.mkdtemp(prefix="sluice-pg-", dir=base))
        root.chmod(0o755)  # the postgres user must reach the data directory
        data = root / "data"
        data.mkdir(mode=0o700)
        if user is not None:
            pw = pwd.getpwnam(user)
            os.chown(data, pw.pw_uid, pw.pw_gid)
        server = cls(root, data, 0, bindir, user, log)
        try:
            server._run(["initdb", "-D", str(data), "-A", "trust", "-U", SUPERUSER,
                         "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions"])
            last = ""
            for _ in range(5):
                server.port = port or free_port()
                settings = ["listen_addresses=127.0.0.1", f"port={server.port}",
                            f"unix_socket_directories={data}", "fsync=on",
                            "synchronous_commit=on", "max_connections=200",
                            *options]
                opts = " ".join(f"-c {s}" for s in settings)
                try:
                    server._run(["pg_ctl", "-D", str(data), "-l", str(server.log),
                                 "-w", "-t", "60", "-o", opts, "start"])
                except PgServerError as exc:
                    last = str(exc)
                    if port is not None:
                        break
                    continue
                server.dsn = (f"host=127.0.0.1 port={server.port} user={SUPERUSER} "
                              "dbname=postgres")
                return server
            raise PgServerError(f"the server did not start: {last}")
        except BaseException:
            server.stop()
            raise

    def _run(self, argv: list[str]) -> None:
        cmd = [str(self.bindir / argv[0]), *argv[1:]]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=120, cwd=self.base,
                user=self.user, group=self.user,
                env={**os.environ, "LC_ALL": "C", "PGTZ": "UTC"},
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PgServerError(f"{argv[0]} failed: {exc}") from exc
        if proc.returncode != 0:
            log = ""
            with contextlib.suppress(OSError):
                log = self.log.read_text()[-2000:]
            raise PgServerError(f"{argv[0]} failed ({proc.returncode}): "
                                f"{proc.stderr.strip() or proc.stdout.strip()} {log}".strip())

    def stop(self) -> None:
        """Stop the server (immediately) and remove its directory."""
        if (self.data / "postmaster.pid").exists():
            with contextlib.suppress(PgServerError):
                self._run(["pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop"])
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> PgServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
