"""A PostgreSQL server of one test's own, with its whole data directory on a small tmpfs.

The test's wrapper mounts the tmpfs in a private mount namespace and runs,
still inside that namespace and before it execs `sluice serve`,

    python -m tests.integration.pg_private start MOUNT PORT INFO LOG

which makes a server (sluice.store._pgserver: initdb, pg_ctl start as the
``postgres`` user) with its data directory, WAL included, under MOUNT, on
127.0.0.1:PORT, its log in LOG (outside the tmpfs, so that it is still
written when the tmpfs is full), and writes INFO (a JSON file outside the
tmpfs too) naming the data directory, the binaries and the user.  The server's processes
stay in the namespace, so the tmpfs lives as long as they or serve do.

    python -m tests.integration.pg_private pg_ctl INFO ARGS...

runs pg_ctl on that data directory; the test calls it through nsenter
(restart after PostgreSQL stopped itself, the final immediate stop).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def start(mount: Path, port: int, info: Path, log: Path) -> None:
    from sluice.store._pgserver import PgServer

    # Small checkpoints keep the WAL a few segments long on the small disk.
    server = PgServer.start(mount, port=port, options=["max_wal_size=64MB",
                                                       "min_wal_size=32MB"], log=log)
    info.write_text(json.dumps({"data": str(server.data), "bindir": str(server.bindir),
                                "user": server.user, "dsn": server.dsn,
                                "log": str(log)}))


def pg_ctl(info: Path, args: list[str]) -> int:
    found = json.loads(info.read_text())
    cmd = [str(Path(found["bindir"]) / "pg_ctl"), "-D", found["data"], "-l", found["log"],
           *args]
    return subprocess.run(cmd, user=found["user"], group=found["user"], timeout=120,
                          check=False, cwd="/").returncode


if __name__ == "__main__":
    if sys.argv[1] == "start":
        start(Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
    elif sys.argv[1] == "pg_ctl":
        sys.exit(pg_ctl(Path(sys.argv[2]), sys.argv[3:]))
