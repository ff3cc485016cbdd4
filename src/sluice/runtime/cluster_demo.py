"""`sluice demo --nodes N`: a cluster on one machine, its limits held across the nodes.

SUMMARY
    run_cluster_demo(nodes=3, messages=600, seed=1, keep=False, timeout=120) -> exit status

DESCRIPTION
    Starts a throwaway PostgreSQL (the shared queue) and Redis (the shared
    limits), a sink in this process, and N ``sluice serve`` nodes, each a
    process of its own with its own node id and SMTP port.  The policy
    allows 3 connections at once to limited.demo.example and 20 pickups a
    second to paced.demo.example for the whole cluster.  Messages go to the
    nodes in turn; the live table shows what the sink sees -- the peak of
    connections to the limited domain stays at 3 however many nodes
    deliver -- and what each node delivered.  It ends with the output of
    ``sluice cluster status``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import smtplib
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import yaml
from rich.console import Console
from rich.live import Live
from rich.table import Table

from sluice._loopback import free_port
from sluice.cluster._redisserver import RedisServer, RedisServerError
from sluice.sink import Behaviour, Sink
from sluice.store._pgserver import PgServer, PgServerError

__all__ = ["run_cluster_demo"]

LIMITED, PACED, FREE = "limited.demo.example", "paced.demo.example", "free.demo.example"
POLICY = f"""\
- fields: [recipientdomain]
  if:
    - {{recipientdomain: {LIMITED}, concurrency: 3}}
    - {{recipientdomain: {PACED}, rate: 20/1}}
"""


def _node_config(home: Path, name: str, port: int, dsn: str, redis_url: str,
                 sink_port: int) -> Path:
    home.mkdir(parents=True)
    (home / "policy.yaml").write_text(POLICY)
    data = {
        "node": {"id": name, "hostname": f"{name}.demo.example"},
        "queue": {"path": str(home / "queue"), "store": "postgres",
                  "postgres": {"dsn": dsn}, "retry_delays": "2s | 5s"},
        "accounting": {"path": str(home / "log")},
        "smtpd": {"listen": [f"127.0.0.1:{port}"], "processes": 1},
        "scheduler": {"policy": str(home / "policy.yaml")},
        "delivery": {"transport": {"*": f"smtp:[127.0.0.1]:{sink_port}"},
                     "timeouts": {"idle": 0}},
        "cluster": {"redis": redis_url, "heartbeat_interval": "1s"},
        "api": {"enabled": False},
    }
    path = home / "sluice.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _start(config: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "sluice", "-c", str(config), "serve"],
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"a node did not start: {log.read_text()[-500:]}")
        with contextlib.suppress(OSError), smtplib.SMTP("127.0.0.1", port, timeout=2):
            return proc
        time.sleep(0.2)
    raise RuntimeError(f"a node did not answer on port {port} in 60 s")


def _delivered_by_node(homes: list[Path]) -> Counter[str]:
    out: Counter[str] = Counter()
    for home in homes:
        for f in (home / "log").glob("*.jsonl"):
            with contextlib.suppress(OSError):
                for line in f.read_text().splitlines():
                    with contextlib.suppress(ValueError):
                        event = json.loads(line)
                        if event.get("event") == "delivered":
                            out[event["node"]] += 1
    return out


def _table(sink: Sink, homes: list[Path], names: list[str], sent: int, total: int) -> Table:
    snap = sink.snapshot()
    t = Table(title=f"Sluice cluster demo: {len(names)} nodes, one PostgreSQL queue, "
                    "limits shared through Redis")
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("sent / total", f"{sent} / {total}")
    t.add_row("delivered at the sink", str(snap.total_delivered))
    t.add_row(f"peak connections to {LIMITED} (policy: 3 for the cluster)",
              str(snap.peak_by_domain.get(LIMITED, 0)))
    paced = sorted(snap.connected_at.get(PACED, []))
    worst = max((sum(1 for u in paced[i:] if u < t0 + 1.0) for i, t0 in enumerate(paced)),
                default=0)
    t.add_row(f"most connections opened in one second to {PACED} (policy: 20/s)", str(worst))
    by_node = _delivered_by_node(homes)
    for name in names:
        t.add_row(f"delivered by {name}", str(by_node.get(name, 0)))
    return t


def run_cluster_demo(nodes: int = 3, messages: int = 600, seed: int = 1, keep: bool = False,
                     timeout: float = 120.0) -> int:
    """Run the cluster demo the module header describes; returns the exit status.

    ``keep`` leaves the demo's directories in place for a look afterwards.
    """
    console = Console()
    base = Path(tempfile.mkdtemp(prefix="sluice-cluster-demo-"))
    pg: PgServer | None = None
    redis: RedisServer | None = None
    procs: list[subprocess.Popen[bytes]] = []
    sink = Sink(default=Behaviour("slow", seconds=0.05), keep=False)
    sink_port = sink.start_in_thread()
    try:
        console.print("starting PostgreSQL and Redis on loopback ...")
        try:
            pg = PgServer.start()  # its own directory: the postgres user must reach it
            redis = RedisServer.start()
        except (PgServerError, RedisServerError) as exc:
            console.print(f"[red]cannot start the demo's servers: {exc}[/red]")
            return 2
        names = [f"n{i}" for i in range(nodes)]
        ports = [free_port() for _ in names]
        homes = [base / name for name in names]
        for name, port, home in zip(names, ports, homes, strict=True):
            config = _node_config(home, name, port, pg.dsn, redis.url, sink_port)
            console.print(f"starting node {name} (SMTP 127.0.0.1:{port}) ...")
            procs.append(_start(config, port, home / "serve.log"))
        domains = [LIMITED, PACED, FREE]
        sent = 0

        def send_all() -> None:
            nonlocal sent
            for i in range(messages):
                port = ports[i % len(ports)]
                domain = domains[(i + seed) % len(domains)]
                with contextlib.suppress(OSError, smtplib.SMTPException), \
                        smtplib.SMTP("127.0.0.1", port, timeout=10) as client:
                    client.sendmail("demo@sender.demo.example", [f"user{i}@{domain}"],
                                    f"Subject: cluster demo {i}\r\n\r\nhello\r\n".encode())
                    sent += 1

        sender = threading.Thread(target=send_all, daemon=True)
        sender.start()
        deadline = time.monotonic() + timeout
        with Live(_table(sink, homes, names, sent, messages), console=console,
                  refresh_per_second=4) as live:
            while time.monotonic() < deadline:
                live.update(_table(sink, homes, names, sent, messages))
                if not sender.is_alive() and sink.snapshot().total_delivered >= sent:
                    break
                time.sleep(0.25)
        status = subprocess.run(
            [sys.executable, "-m", "sluice", "-c", str(homes[0] / "sluice.yaml"), "cluster",
             "status"], capture_output=True, text=True, timeout=60)
        console.print("\n$ sluice cluster status")
        console.print(status.stdout.rstrip() or status.stderr.rstrip(), markup=False)
        done = sink.snapshot().total_delivered
        console.print(f"\n{done} of {sent} messages delivered; peak "
                      f"{sink.snapshot().peak_by_domain.get(LIMITED, 0)} connections to "
                      f"{LIMITED} with a cluster limit of 3.")
        if keep:
            console.print(f"kept in {base}")
        return 0 if done >= sent else 1
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        sink.stop_thread()
        if redis is not None:
            redis.stop()
        if pg is not None:
            pg.stop()
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
