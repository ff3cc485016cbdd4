"""A shaping rule that fires on one node holds the destination on the other, and its lift frees it.

Two `sluice serve` nodes share a real PostgreSQL queue and a real Redis and
deliver to one loopback sink (sluice.sink) that answers ``451 4.3.0`` for
held.example.  Both read the same rules file: a 451 4.3.0 from held.example
suspends the domain.  Whichever node delivers the first message gets the
refusal and its rule fires; the test then looks at the *other* node: its
scheduler holds the suspension (``GET /api/v1/suspensions``), under the id
that names the node whose rule fired, while its shaper lists nothing of its
own and its audit history has no record of it (audited once, where it
fired).  The sink then accepts again, but nothing reaches it until
`sluice shaping lift` on the firing node: the lift frees the other node too,
and the queued mail goes out.
"""

from __future__ import annotations

import contextlib
import signal
import smtplib
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.cluster._redisserver import RedisServer
from sluice.sink import Behaviour, Sink
from tests.integration.pg import dsn_for
from tests.integration.redis_srv import redis_server
from tests.integration.serving import (
    Serving,
    free_port,
    start_serve_with,
    wait_until,
    write_serve_config,
)

__all__ = ["redis_server"]

pytestmark = pytest.mark.integration

TOKEN = "cluster-shaping-token-0123456789"
HELD = "held.example"
RULES = """
rules:
  - name: hold
    where: {domain: held.example}
    reply: {code: 451, enhanced: 4.3.0}
    trigger: {matches: 1}
    action: suspend
    duration: 10m
    note: the test's destination asked for a pause
"""


def start_node(tmp: Path, name: str, dsn: str, redis_url: str, sink_port: int,
               rules: Path) -> tuple[Serving, str]:
    home = tmp / name
    home.mkdir()
    port, api_port = free_port(), free_port()
    config = write_serve_config(
        home, port,
        node={"id": name, "hostname": f"{name}.sluice.test"},
        queue={"store": "postgres", "postgres": {"dsn": dsn}, "retry_delays": "1s"},
        delivery={"transport": {"*": f"smtp:[127.0.0.1]:{sink_port}"},
                  "shaping": str(rules), "shaping_defaults": False},
        cluster={"redis": redis_url, "heartbeat_interval": "0.5s"},
        api={"enabled": True, "listen": f"127.0.0.1:{api_port}", "tokens": {"ops": TOKEN}})
    return start_serve_with(config, home, port), f"http://127.0.0.1:{api_port}/api/v1"


def get(url: str) -> Any:
    return httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()


def send(node: Serving, n: int) -> None:
    with smtplib.SMTP("127.0.0.1", node.port, timeout=10) as client:
        client.sendmail("s@sender.example", [f"r{n}@{HELD}"],
                        f"Subject: held {n}\r\n\r\nbody {n}\r\n".encode())


def suspension_ids(api: str) -> set[str]:
    return {v["id"] for v in get(f"{api}/suspensions")["manual"]}


def test_a_shaping_suspension_holds_every_node_until_lifted_where_it_fired(
        tmp_path: Path, redis_server: RedisServer) -> None:
    sink = Sink({HELD: Behaviour("tempfail")})
    sport = sink.start_in_thread()
    dsn = dsn_for(tmp_path)
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    nodes: list[Serving] = []
    apis: list[str] = []
    try:
        for name in ("n0", "n1"):
            node, api = start_node(tmp_path, name, dsn, redis_server.url, sport, rules)
            nodes.append(node)
            apis.append(api)
        send(nodes[0], 0)

        # One node delivered it, got the 451 and its rule fired.
        def firing() -> int | None:
            for i, api in enumerate(apis):
                if get(f"{api}/shaping")["active"]:
                    return i
            return None

        assert wait_until(lambda: firing() is not None, 15, step=0.1), "no rule fired"
        fired = firing()
        assert fired is not None
        other = 1 - fired
        name = f"n{fired}"
        [action] = get(f"{apis[fired]}/shaping")["active"]
        sid = action["id"]
        assert sid == f"shaping:{name}:hold:1"  # the id says whose it is
        made = time.monotonic()

        # The other node holds it, under the same id, within a second or so ...
        assert wait_until(lambda: sid in suspension_ids(apis[other]), 5, step=0.05), (
            f"n{other} never held {sid}:\n" + "\n".join(nodes[other].output[-20:]))
        took = time.monotonic() - made
        [held] = [v for v in get(f"{apis[other]}/suspensions")["manual"] if v["id"] == sid]
        assert held["fields"] == {"recipientdomain": HELD}
        assert "by rule hold" in held["reason"] and "451 4.3.0" in held["reason"]
        # ... but its shaper lists nothing of its own, and it audits nothing.
        assert get(f"{apis[other]}/shaping")["active"] == []
        assert sid not in httpx.get(f"{apis[other]}/audit", timeout=10, headers={
            "Authorization": f"Bearer {TOKEN}"}).text

        # The destination accepts again; mail sent to the other node stays queued.
        sink.behaviours[HELD] = Behaviour("accept")
        send(nodes[other], 1)
        time.sleep(3.0)  # three retry delays: long enough for either node to try
        assert sink.snapshot().delivered[HELD] == 0, "a node delivered while suspended"

        # The lift on the node whose rule fired frees both, and the mail goes out.
        nodes[fired].run("shaping", "lift", action["key"])
        assert wait_until(lambda: sid not in suspension_ids(apis[other]), 5, step=0.05), (
            f"n{other} still holds {sid} after the lift")
        assert wait_until(lambda: sink.snapshot().delivered[HELD] == 2, 15, step=0.1), (
            f"delivered {sink.snapshot().delivered[HELD]} of 2 after the lift")
        print(f"\na shaping suspension on {name} held n{other} after {took:.2f} s")

        # Audited once, on the node whose rule fired: the firing and the lift.
        records = get(f"{apis[fired]}/audit")["records"]
        assert [r["action"] for r in records if r["target"] == sid] \
            in (["shaping.fire", "shaping.end"], ["shaping.end", "shaping.fire"])
        assert not [r for r in get(f"{apis[other]}/audit")["records"]
                    if r["action"].startswith("shaping.") and r["action"] != "shaping.reload"]
    finally:
        for node in nodes:
            with contextlib.suppress(Exception):
                node.stop(signal.SIGKILL)
        sink.stop_thread()
