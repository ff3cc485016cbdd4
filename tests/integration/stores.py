"""The store flavours every conformance test runs against.

A flavour is added here once (FLAVOURS plus a branch in ``flavour_sections``);
the whole contract in test_store_contract.py, the life cycle, the property
test and the crash test then run against it.  The postgres flavour gets a
schema of its own per queue directory on the tests' server (tests/integration/pg.py).
"""

from __future__ import annotations

import functools
import sqlite3
from pathlib import Path
from typing import Any

from sluice.config import Config
from sluice.model import QueueState, Reply, Selector, Submission
from sluice.store import Action, Store, Transition, open_store
from tests.conftest import make_config

#: ``sqlite`` keeps small content in the database and the rest in spool
#: segments (the default); ``sqlite_files`` is the same store with every
#: message in a spool file of its own, ``sqlite_segments`` with every
#: message in a segment.
FLAVOURS: list[str] = ["sqlite", "sqlite_files", "sqlite_segments", "fs", "postgres", "kv"]


def flavour_sections(flavour: str, tmp: Path) -> dict[str, dict[str, Any]]:
    """Config sections that select ``flavour`` with its state under ``tmp``."""
    if flavour == "postgres":
        from tests.integration.pg import dsn_for

        return {"queue": {"store": "postgres", "postgres": {"dsn": dsn_for(tmp)}}}
    if flavour == "sqlite_files":
        return {"queue": {"store": "sqlite", "spool": {"inline_max": 0, "layout": "files"}}}
    if flavour == "sqlite_segments":
        return {"queue": {"store": "sqlite", "spool": {"inline_max": 0, "layout": "segments"}}}
    return {"queue": {"store": flavour}}


def flavour_config(flavour: str, tmp: Path, **sections: dict[str, Any]) -> Config:
    merged = flavour_sections(flavour, tmp)
    for name, values in sections.items():
        base = merged.setdefault(name, {})
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                base[key] = {**base[key], **value}
            else:
                base[key] = value
    return make_config(tmp, **merged)


def open_flavour(flavour: str, tmp: Path, **sections: dict[str, Any]) -> Store:
    return open_store(flavour_config(flavour, tmp, **sections))


def fail_inserts(store: Any, monkeypatch: Any, error: str) -> None:
    """The SQL stores' insert of a message's rows raises sqlite3.OperationalError(error)."""

    def broken(conn: object, rows: object) -> None:
        raise sqlite3.OperationalError(error)

    monkeypatch.setattr(store._sql, "insert", broken)


def spy_dirs(monkeypatch: Any, module: Any, name: str) -> list[str]:
    """The names of the directories ``module.name`` (a listing function) is called on.

    The list grows as the calls come; the function still does its work.
    """
    seen: list[str] = []
    real = getattr(module, name)

    def spy(path: Any) -> Any:
        seen.append(path.name)
        return real(path)

    monkeypatch.setattr(module, name, spy)
    return seen


# --------------------------------------------------------------------------
# A full disk, in a child process inside a private mount namespace.
#
#   unshare -m sh -c 'mount -t tmpfs -o size=4m tmpfs DIR && \
#       exec python -m tests.integration.stores diskfull FLAVOUR DIR'
#
# The child fills a small tmpfs through the store until it refuses, and
# prints one JSON line: what it saw, checked from inside (the parent cannot
# see the tmpfs).


def diskfull_scenario(flavour: str, mount: Path, ballast_mb: int = 1,
                      body_kb: int = 192) -> dict[str, Any]:
    """Fill ``mount`` through a store; free space; check; returns the findings."""
    import hashlib
    import os
    import time

    from sluice.model import Selector, Submission
    from sluice.store import StorageError

    ballast = mount / "ballast"
    ballast.write_bytes(b"\0" * (ballast_mb << 20))  # freed later, as an operator would
    server = None
    if flavour == "postgres":
        import pwd

        import psycopg
        from psycopg.conninfo import make_conninfo

        from sluice.store._pgserver import PgServer
        from sluice.store.postgres import PgStore

        ts = mount / "ts"
        ts.mkdir()
        pw = pwd.getpwnam("postgres")
        os.chown(ts, pw.pw_uid, pw.pw_gid)
        server = PgServer.start()
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE TABLESPACE small LOCATION '{ts}'")
        store: Store = PgStore(make_conninfo(server.dsn, options="-c default_tablespace=small"),
                               node_id="full")
    else:
        store = open_flavour(flavour, mount)
    out: dict[str, Any] = {"accepted": 0, "error": None, "other_error": None}
    digests: dict[str, str] = {}
    try:
        body = os.urandom(body_kb * 512).hex().encode()
        for i in range(400):
            content = b"Subject: %d\r\n\r\n" % i + body
            try:
                acc = store.submit(Submission("a@example.org", ("b@example.net",)), content,
                                   time.time())
            except StorageError as exc:
                out["error"] = str(exc)
                break
            except Exception as exc:
                out["other_error"] = f"{type(exc).__name__}: {exc}"
                break
            digests[acc.spid] = hashlib.sha256(content).hexdigest()
        out["accepted"] = len(digests)
        # A second attempt on the full disk fails the same way, and the
        # store still answers readers.
        try:
            store.submit(Submission("a@example.org", ("b@example.net",)), body, time.time())
            out["second_ok"] = True
        except StorageError:
            out["second_ok"] = False
        listed = {e.spid for e in store.entries(Selector())}
        out["all_listed"] = set(digests) <= listed and len(listed) == len(digests)
        intact = True
        for spid, digest in digests.items():
            with store.open_content(spid) as stream:
                intact &= hashlib.sha256(stream.read()).hexdigest() == digest
        out["all_intact"] = intact
        out["count"] = store.count().messages
        # The operator frees space: the store works again, without a restart.
        ballast.unlink()
        for e in list(store.entries(Selector()))[:3]:
            store.modify(Selector(qids=(e.spid,)), Action.DELETE, time.time())
        acc = None
        for _ in range(20):
            try:
                acc = store.submit(Submission("a@example.org", ("b@example.net",)),
                                   b"Subject: after\r\n\r\nsmall\r\n", time.time())
                break
            except StorageError as exc:
                out["after_error"] = str(exc)
                time.sleep(0.2)
        out["after_ok"] = acc is not None
        out["count_after"] = store.count().messages
    finally:
        store.close()
        if server is not None:
            server.stop()
    return out


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1:2] == ["diskfull"]:
        print(json.dumps(diskfull_scenario(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]),
                                           int(sys.argv[5]))), flush=True)


@functools.cache
def private_mounts_refused() -> str | None:
    """Why a child cannot mount a tmpfs in a mount namespace of its own, or None if it can."""
    import shutil
    import subprocess
    import tempfile

    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    where = tempfile.mkdtemp(prefix="sluice-unshare-")
    try:
        proc = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c",
             'mount -t tmpfs -o size=1m tmpfs "$1" && umount "$1"', "sh", where],
            capture_output=True, text=True, timeout=30)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    if proc.returncode != 0:
        return f"no private tmpfs mount here (needs CAP_SYS_ADMIN): {proc.stderr.strip()}"
    return None


def skip_without_private_mounts() -> None:
    """Skips the calling test, with the reason, where a full disk cannot be made."""
    import pytest

    reason = private_mounts_refused()
    if reason is not None:
        pytest.skip(reason)


def run_diskfull(flavour: str, size: str = "4m", ballast_mb: int = 1,
                 body_kb: int = 192) -> dict[str, Any]:
    """Run diskfull_scenario in a child with a tmpfs of ``size`` of its own.

    Skips the test where mount namespaces are not allowed (no root, a
    locked-down container).
    """
    import json
    import shutil
    import subprocess
    import sys
    import tempfile

    from tests.conftest import ROOT, subprocess_env

    skip_without_private_mounts()
    # Not under pytest's tmp_path: the postgres user must reach the mount point.
    mount = Path(tempfile.mkdtemp(prefix="sluice-full-"))
    mount.chmod(0o755)
    script = ('mount -t tmpfs -o size="$4",mode=0755 tmpfs "$1" && '
              'exec "$2" -m tests.integration.stores diskfull "$3" "$1" "$5" "$6"')
    try:
        proc = subprocess.run(
            ["unshare", "-m", "sh", "-c", script, "sh", str(mount), sys.executable, flavour,
             size, str(ballast_mb), str(body_kb)],
            capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=300)
    finally:
        shutil.rmtree(mount, ignore_errors=True)
    assert proc.returncode == 0, f"the child failed: {proc.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def check_migrated_v1_queue(store: Store, spid: str, recipient: str, content: bytes,
                            now: float) -> None:
    """A queue written before the SMTPUTF8 flag and before replies said who
    and when, once migrated: its one message (``spid`` to ``recipient``)
    reads as not flagged and keeps its content, a flagged message queued
    now keeps its flag, and a reply recorded now keeps its remote MTA and
    time."""
    (old,) = store.entries(Selector())
    assert (old.spid, old.recipient, old.smtputf8) == (spid, recipient, False)
    new = store.submit(Submission("a@example.org", ("c@example.net",), smtputf8=True),
                       b"new", now)
    claimed = store.claim(10, now, 10)
    assert {e.spid: e.smtputf8 for e in claimed} == {spid: False, new.spid: True}
    with store.open_content(spid) as stream:
        assert stream.read() == content
    said = Reply(451, "4.2.0", "busy", remote_mta="mx.example.net", attempt_at=now)
    store.apply([Transition(f"{spid}-0", QueueState.DEFERRED, next_attempt_at=now + 60,
                            reply=said, attempted=True)])
    got = store.get(f"{spid}-0")
    assert got is not None and got.last_reply == said
