"""Delivery client throughput: Sluice's SMTP client vs aiosmtplib, against Postfix's smtp-sink.

Both clients send the same N messages (1 KB by default) over C parallel
connections to one smtp-sink on 127.0.0.1, reusing their connections; each
message is one transaction with one recipient, read from an in-memory
stream.  Sluice's client is the DeliveryAgent as the runtime calls it (a
DeliveryRequest per message, outcomes checked); aiosmtplib is its
SMTP.sendmail() on C long-lived clients.  smtp-sink advertises PIPELINING,
which Sluice uses and aiosmtplib does not.

Runs alternate between the clients (--repeat times) and the medians are
printed -- throughput, and the client process's CPU time per message, which
a busy machine disturbs less -- then one machine-readable line:

    delivery_bench sluice_msgs_per_s=X aiosmtplib_msgs_per_s=Y ratio=X/Y ...

    .venv/bin/python bench/delivery_bench.py                  # 20000 x 1 KB, 20 connections
    .venv/bin/python bench/delivery_bench.py -n 5000 -c 50 --size 102400 --uvloop

Needs /usr/sbin/smtp-sink (Debian package postfix).  The machine is shared
and noisy (+-15 %): compare medians, not single runs.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import shutil
import socket
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import aiosmtplib

from sluice.config import config_from_dict
from sluice.delivery import DeliveryAgent, DeliveryRequest, Host, NextHop
from sluice.model import Delivered, QueueEntry, QueueState
from sluice.scheduler.events import Transport

#: Connections opened beyond the first one per worker, per client (should stay 0).
RECONNECTS = {"sluice": 0, "aiosmtplib": 0}


def message(size: int) -> bytes:
    """A message of exactly ``size`` bytes (at least the header): 78-column lines."""
    head = b"From: bench@src.test\r\nTo: sink@dest.test\r\nSubject: delivery bench\r\n\r\n"
    line = b"x" * 76 + b"\r\n"
    rest = max(0, size - len(head))
    body = line * (rest // len(line))
    tail = rest - len(body)
    if tail:
        body += b"y" * max(0, tail - 2) + b"\r\n"[: min(tail, 2)]
    return head + body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_sink(binary: str, port: int) -> subprocess.Popen[bytes]:
    args = [binary, "-h", "sink.test"]
    if os.geteuid() == 0:
        args += ["-u", "nobody"]
    proc = subprocess.Popen([*args, f"127.0.0.1:{port}", "1000"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise SystemExit("smtp-sink did not start")


async def run_sluice(port: int, n: int, conns: int, data: bytes) -> float:
    cfg = config_from_dict({"node": {"hostname": "bench.test"}, "delivery": {
        "starttls": "none", "max_messages_per_connection": n + 1}})
    agent = DeliveryAgent.from_config(cfg)
    route = NextHop(Transport.SMTP, (Host("sink.test", "127.0.0.1", port),), "bench")

    def opener() -> io.BytesIO:
        return io.BytesIO(data)

    async def worker(k: int) -> None:
        for i in range(k, n, conns):
            entry = QueueEntry(spid=f"{i:016X}", idx=0, sender="bench@src.test",
                               recipient=f"r{i}@dest.test", state=QueueState.DELIVERING,
                               arrival_at=0.0, next_attempt_at=0.0, size=len(data))
            res = await agent.deliver(DeliveryRequest(route, (entry,), opener))
            if not isinstance(res.outcomes[0][1], Delivered):
                raise SystemExit(f"sluice: not delivered: {res.outcomes[0][1]}")

    started = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(conns)))
    elapsed = time.perf_counter() - started
    RECONNECTS["sluice"] += agent.stats.connections_opened - conns
    await agent.close()
    return n / elapsed


async def run_aiosmtplib(port: int, n: int, conns: int, data: bytes) -> float:
    async def worker(k: int) -> None:
        client = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, local_hostname="bench.test",
                                 start_tls=False, use_tls=False)
        await client.connect()
        for i in range(k, n, conns):
            for _ in range(3):
                try:
                    errors, _ = await client.sendmail("bench@src.test", [f"r{i}@dest.test"],
                                                      data)
                    break
                except aiosmtplib.SMTPServerDisconnected:
                    # As Sluice's agent does with a dead cached connection: reconnect.
                    RECONNECTS["aiosmtplib"] += 1
                    client.close()
                    await client.connect()
            else:
                raise SystemExit("aiosmtplib: the server keeps hanging up")
            if errors:
                raise SystemExit(f"aiosmtplib: refused: {errors}")
        try:
            await client.quit()
        except aiosmtplib.SMTPException:
            client.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(conns)))
    return n / (time.perf_counter() - started)


def run_one(fn: Callable[..., Coroutine[Any, Any, float]], uvloop_: bool, *args: Any) -> float:
    coro: Awaitable[float] = fn(*args)
    if uvloop_:
        import uvloop

        return uvloop.run(coro)  # type: ignore[arg-type]
    return asyncio.run(coro)  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--messages", type=int, default=20000)
    ap.add_argument("-c", "--connections", type=int, default=20)
    ap.add_argument("--size", type=int, default=1024, help="message size in bytes")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--uvloop", action="store_true", help="run both clients on uvloop")
    ap.add_argument("--smtp-sink", default=shutil.which("smtp-sink") or "/usr/sbin/smtp-sink")
    args = ap.parse_args()
    if not os.path.exists(args.smtp_sink):
        raise SystemExit(f"{args.smtp_sink} not found (apt-get install postfix)")
    data = message(args.size)
    port = free_port()
    sink = start_sink(args.smtp_sink, port)
    figures: dict[str, list[float]] = {"sluice": [], "aiosmtplib": []}
    cpu: dict[str, list[float]] = {"sluice": [], "aiosmtplib": []}
    try:
        # Warm up both code paths once (imports, first connections).
        run_one(run_sluice, args.uvloop, port, 200, args.connections, data)
        run_one(run_aiosmtplib, args.uvloop, port, 200, args.connections, data)
        for r in range(args.repeat):
            for name, fn in (("sluice", run_sluice), ("aiosmtplib", run_aiosmtplib)):
                cpu_before = time.process_time()
                rate = run_one(fn, args.uvloop, port, args.messages, args.connections, data)
                cpu_us = (time.process_time() - cpu_before) / args.messages * 1e6
                figures[name].append(rate)
                cpu[name].append(cpu_us)
                print(f"run {r + 1}: {name:10s} {rate:8.0f} msg/s  {cpu_us:6.0f} us CPU/msg",
                      flush=True)
    finally:
        sink.terminate()
        sink.wait()
    ours = statistics.median(figures["sluice"])
    theirs = statistics.median(figures["aiosmtplib"])
    ours_cpu = statistics.median(cpu["sluice"])
    theirs_cpu = statistics.median(cpu["aiosmtplib"])
    loop = "uvloop" if args.uvloop else "asyncio"
    print(f"median: sluice {ours:.0f} msg/s, aiosmtplib {theirs:.0f} msg/s, "
          f"ratio {ours / theirs:.2f} ({args.messages} x {len(data)} B, "
          f"{args.connections} connections, {loop}); client CPU per message: "
          f"sluice {ours_cpu:.0f} us, aiosmtplib {theirs_cpu:.0f} us")
    print(f"delivery_bench sluice_msgs_per_s={ours:.0f} aiosmtplib_msgs_per_s={theirs:.0f} "
          f"ratio={ours / theirs:.2f} sluice_cpu_us={ours_cpu:.0f} "
          f"aiosmtplib_cpu_us={theirs_cpu:.0f} n={args.messages} connections={args.connections} "
          f"size={len(data)} loop={loop} repeat={args.repeat} "
          f"reconnects_sluice={RECONNECTS['sluice']} "
          f"reconnects_aiosmtplib={RECONNECTS['aiosmtplib']}")


if __name__ == "__main__":
    main()
