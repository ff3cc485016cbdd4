"""PostgreSQL's disk fills under `sluice serve`: 451, not 250, and nothing accepted is lost.

The postgres flavour of tests/integration/test_serve_diskfull.py.  The test
runs a PostgreSQL server of its own (tests/integration/pg_private.py) whose
whole data directory, WAL included, is on a 64 MB tmpfs in a private mount
namespace (unshare -m), and `sluice serve` in the same namespace on it.
Ten messages are accepted while the destination answers 4xx, so they stay
queued; then the tmpfs is filled to the last byte (nsenter).  What
PostgreSQL does then comes in two steps, and the test goes through both:

1. Its table files cannot grow.  A write that needs a new page fails with
   ERROR "could not extend file ... No space left on device"; the server
   stays up.  A message that still fits in pages the tables already have
   may be stored and answered 250 (it must then be delivered); the rest
   get 451 4.3.0.
2. The WAL needs a new segment file (here forced with pg_switch_wal(), as
   a timed checkpoint, archive_timeout or enough traffic does it anyway).
   Writing it fails in a critical section: PANIC, every backend is
   killed, crash recovery cannot write its checkpoint either, and the
   postmaster shuts down.  PostgreSQL is gone; Sluice answers 451 4.3.0
   (connection refused) and keeps running.

Then the operator frees the space and starts PostgreSQL again (crash
recovery); the destination accepts again.  Sluice reconnects by itself:
every message answered 250 is delivered, a new message is answered 250
and delivered, none of those answered 451 is.  Throughout, each part that
fails logs one warning (and a reminder a minute), never a traceback.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

from sluice.sink import Behaviour, Sink
from sluice.store._pgserver import SUPERUSER, find_bindir
from tests.conftest import ROOT, subprocess_env
from tests.integration.serving import free_port, start_serve_with, wait_until, write_serve_config
from tests.integration.stores import skip_without_private_mounts
from tests.integration.test_serve_diskfull import ID_RE, send, tempfails

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.postgres]

BEFORE = 10
#: The first warning of a part that fails, and its reminders (sluice.runtime.parts).
PART_FAILED = re.compile(r"sluice\.parts: (.+?) failed: ")
PART_REMINDER = re.compile(r"sluice\.parts: (.+?) still failing: ")


def shared_dir(prefix: str, mode: int) -> Path:
    """A directory the ``postgres`` user can reach (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(mode)
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(path, pw.pw_uid, pw.pw_gid)
    return path


def test_postgres_full_disk_then_gone_answers_451_and_delivers_what_was_accepted(
        tmp_path: Path) -> None:
    skip_without_private_mounts()
    if find_bindir() is None:
        pytest.skip("PostgreSQL's server binaries are not installed")
    mount, logdir = shared_dir("sluice-pgfull-", 0o755), shared_dir("sluice-pgfull-log-", 0o700)
    info, pglog = tmp_path / "pg.json", logdir / "server.log"
    sink = Sink(keep=True, default=Behaviour("tempfail"))
    sport = sink.start_in_thread()
    pgport, port = free_port(), free_port()
    dsn = f"host=127.0.0.1 port={pgport} user={SUPERUSER} dbname=postgres"
    config = write_serve_config(tmp_path, port, smtpd={"processes": 1},
                                queue={"store": "postgres", "postgres": {"dsn": dsn}},
                                delivery={"transport": {"*": f"smtp:[127.0.0.1]:{sport}"}})
    wrapper = ("unshare", "-m", "--propagation", "private", "sh", "-c",
               'mount -t tmpfs -o size=64m,mode=0755 tmpfs "$0" && '
               f'"{sys.executable}" -m tests.integration.pg_private start "$0" {pgport} '
               f'"{info}" "{pglog}" && exec "$@"', str(mount))
    srv = None
    pids: list[int] = []
    try:
        srv = start_serve_with(config, tmp_path, port, wrapper=wrapper)
        inside = ("nsenter", "-t", str(srv.proc.pid), "-m", "sh", "-c")

        def pg_ctl(*args: str) -> int:
            return subprocess.run(
                [*inside, f'cd "{ROOT}" && "{sys.executable}" -m tests.integration.pg_private '
                 f'pg_ctl "{info}" {" ".join(args)}'],
                env=subprocess_env(), timeout=180, check=False, capture_output=True).returncode

        def postmaster() -> int:
            # Its process id, to stop it once serve (and the namespace's entry) is gone.
            out = subprocess.run(
                [*inside, f'cd "{ROOT}" && "{sys.executable}" -m tests.integration.pg_private '
                 f'pg_ctl "{info}" status'], env=subprocess_env(), timeout=180, check=False,
                capture_output=True, text=True).stdout
            found = re.search(r"PID: (\d+)", out)
            assert found, out
            return int(found.group(1))

        def pg_log() -> str:
            return pglog.read_text(errors="replace")

        pids[:] = [postmaster()]
        for i in range(BEFORE):
            reply = send(port, f"b{i}")
            assert reply[0] == 250, reply
        assert wait_until(lambda: tempfails(sink) >= BEFORE, 60)
        started = time.monotonic()
        subprocess.run([*inside, f'cat /dev/zero > "{mount}/filler"'],
                       check=False, capture_output=True, timeout=60)

        # 1. The tables cannot grow; PostgreSQL stays up.
        accepted = {f"b{i}" for i in range(BEFORE)}
        refused: set[str] = set()
        for i in range(8):
            ident = f"full{i}"
            code, text = send(port, ident, size=100_000)
            assert code in (250, 451), (code, text)
            if code == 250:
                accepted.add(ident)  # it fitted in pages the tables had: it was stored
            else:
                assert text[:5] == b"4.3.0", text
                refused.add(ident)
        assert len(refused) >= 6, refused
        assert "could not extend file" in pg_log()
        assert pg_ctl("status") == 0, pg_log()[-3000:]

        # 2. The WAL needs a new segment: PANIC, and PostgreSQL stops.
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_switch_wal()")
        assert wait_until(lambda: pg_ctl("status") == 3, 60), pg_log()[-3000:]
        pids.clear()
        assert "PANIC:  could not write to file \"pg_wal/" in pg_log()
        assert "shutting down due to startup process failure" in pg_log()
        for i in range(4):
            ident = f"gone{i}"
            code, text = send(port, ident, size=100_000)
            assert (code, text[:5]) == (451, b"4.3.0"), text
            refused.add(ident)
        assert srv.proc.poll() is None

        # The operator frees space and starts PostgreSQL (crash recovery);
        # the destination takes mail again.  Sluice reconnects by itself.
        subprocess.run([*inside, f'rm "{mount}/filler"'], check=True, timeout=60)
        assert pg_ctl("-w", "-t", "120", "restart") == 0, pg_log()[-3000:]
        pids[:] = [postmaster()]  # the first one is gone: never signal a stale id
        sink.default = Behaviour("accept")
        assert wait_until(lambda: send(port, "after")[0] == 250, 60)
        accepted.add("after")

        def delivered() -> set[str]:
            return {m.decode() for msg in list(sink.messages) for m in ID_RE.findall(msg.data)}

        assert wait_until(lambda: delivered() >= accepted, 180), sorted(accepted - delivered())
        assert not delivered() & refused, sorted(delivered() & refused)
        elapsed = time.monotonic() - started
    finally:
        code = srv.stop() if srv is not None else 0
        for pid in pids:  # immediate shutdown, after serve: its log ends with serve's own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGQUIT)
        sink.stop_thread()
        shutil.rmtree(mount, ignore_errors=True)
        shutil.rmtree(logdir, ignore_errors=True)
    assert code == 0
    log = "\n".join(srv.output)
    at = log.find("Traceback")
    assert at < 0, log[max(0, at - 500):at + 3000]
    # One warning per failing part and run of failures (the parts fail twice
    # at most: the full disk, then PostgreSQL gone), a reminder a minute.
    for pattern, most in ((PART_FAILED, 2), (PART_REMINDER, 2 * (elapsed // 60 + 1))):
        seen: dict[str, int] = {}
        for name in pattern.findall(log):
            seen[name] = seen.get(name, 0) + 1
        assert all(n <= most for n in seen.values()), (seen, log[-5000:])
