"""How fast can plain aiosmtpd take mail on this machine?  A ceiling for the receiving side.

Postfix's smtp-source (20 sessions, connections kept, 1 KB) sends to two
receivers in turn on 127.0.0.1:

  aiosmtpd   aiosmtpd's SMTP class on uvloop, one process, with a handler
             that answers 250 to DATA and keeps nothing: no store, no fsync,
             no Received header, no policy.  What the library costs alone.
  sluice     Sluice's receiver (sluice.smtpd), one process, queueing every
             message in the SQLite queue with fsync before the 250 (the
             same setup as bench/accept_bench.py).

Each run prints messages per second and the receiving process's CPU per
message; the last line gives the medians and the ratio sluice/aiosmtpd.
The issue's end-to-end goal needs about 1 670 messages per second through
receive, queue and delivery on two cores shared with smtp-source and
smtp-sink; this shows what one of those steps costs with the library the
issue prescribes.

    .venv/bin/python bench/aiosmtpd_ceiling.py [--runs 5] [-n 20000]

Numbers on the shared 2-core machine move by +-15 %; runs alternate.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accept_bench import SMTP_SOURCE, free_port, proc_cpu_s, run_once

#: The no-op server, run with this interpreter in a child process.
NOOP_SERVER = """
import asyncio, sys, uvloop
from aiosmtpd.smtp import SMTP

class Handler:
    async def handle_DATA(self, server, session, envelope):
        return "250 2.0.0 Ok"

async def main(port):
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: SMTP(Handler(), hostname="ceiling.test", ident="ceiling"), "127.0.0.1", port)
    print("ready", flush=True)
    await server.serve_forever()

uvloop.run(main(int(sys.argv[1])))
"""


def run_noop(args: argparse.Namespace) -> tuple[float, float]:
    """(messages per second, CPU ms per message) of the no-op aiosmtpd server."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", NOOP_SERVER, str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the aiosmtpd server did not start")
        subprocess.run([SMTP_SOURCE, "-s", "2", "-m", "20", "-l", str(args.size), "-f",
                        "from@bench.example", "-t", "to@d1.example", f"127.0.0.1:{port}"],
                       check=True, stdout=subprocess.DEVNULL)  # warm up
        cpu0 = proc_cpu_s(server.pid, children=False)
        t0 = time.perf_counter()
        subprocess.run([SMTP_SOURCE, "-d", "-s", str(args.sessions), "-m", str(args.messages),
                        "-l", str(args.size), "-f", "from@bench.example", "-t", "to@d1.example",
                        f"127.0.0.1:{port}"], check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - t0
        cpu = proc_cpu_s(server.pid, children=False) - cpu0
    finally:
        server.terminate()
        server.wait(10)
    return args.messages / seconds, 1000 * cpu / args.messages


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("-n", "--messages", type=int, default=20000)
    ap.add_argument("-s", "--sessions", type=int, default=20)
    ap.add_argument("--size", type=int, default=1024)
    args = ap.parse_args()
    # What accept_bench's run_once reads besides these.
    args.recipients, args.dir = 1, None
    results: dict[str, list[tuple[float, float]]] = {"aiosmtpd": [], "sluice": []}
    for i in range(args.runs):
        for name in (("aiosmtpd", "sluice") if i % 2 == 0 else ("sluice", "aiosmtpd")):
            if name == "aiosmtpd":
                rate, cpu_ms = run_noop(args)
            else:
                run = run_once(args, 1, "reuse", None)
                if run.queued != args.messages:
                    raise SystemExit(f"sluice queued {run.queued} of {args.messages} messages")
                rate, cpu_ms = run.rate, run.cpu_ms_per_msg
            results[name].append((rate, cpu_ms))
            print(f"run {i + 1} {name:8} {rate:7.0f} msg/s  {cpu_ms:.3f} ms CPU/msg", flush=True)
    med = {name: (statistics.median(r for r, _ in runs), statistics.median(c for _, c in runs))
           for name, runs in results.items()}
    for name, (rate, cpu_ms) in med.items():
        print(f"median   {name:8} {rate:7.0f} msg/s  {cpu_ms:.3f} ms CPU/msg")
    print(f"aiosmtpd_noop={med['aiosmtpd'][0]:.0f} sluice_receiver={med['sluice'][0]:.0f} "
          f"ratio={med['sluice'][0] / med['aiosmtpd'][0]:.2f} "
          f"cpu_ms_noop={med['aiosmtpd'][1]:.3f} cpu_ms_sluice={med['sluice'][1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
