#!/usr/bin/env python3
"""End to end: smtp-source -> MTA -> smtp-sink on loopback, Sluice against Postfix.

    .venv/bin/python bench/e2e.py [--runs 5] [--n 20000] [--sessions 20]
                                  [--configs base,big,rcpt5] [--no-postfix]
                                  [--sync-method fsync|syncfs]

Both MTAs are measured with the shared harness in ../shared/bench (run from
there, not copied): e2e_run.py drives smtp-source against the MTA and
counts what smtp-sink receives; postfix_e2e.sh runs a private Postfix
(fsync before 250, maillog on).  Sluice runs `sluice serve` on a fresh
SQLite queue (fsync before 250, accounting log on), relaying everything to
the same smtp-sink with its default 20-connection limit per destination.

Configurations (as ../shared/bench/run_matrix.py):
  base   N x 1 KB, 20 sessions, one recipient domain
  big    N x 100 KB
  rcpt5  5 recipients per message, 5 smtp-source processes with one domain
         each (smtp-source puts all recipients of one message in one domain)

Runs are interleaved (Sluice, Postfix, Sluice, ...; the order alternates)
and the medians of each MTA's runs are compared.  The machine is shared and
noisy (about +-15 %): every run line carries the harness's contamination
figures.  The last line reads
    sluice_e2e=X postfix_e2e=Y ratio=X/Y
for the base configuration.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HARNESS = (ROOT / ".." / "shared" / "bench").resolve()
SLUICE = str(Path(sys.executable).parent / "sluice")

CONFIGS = {
    "base": {"size": 1024, "rcpts": 1, "domains": 1},
    "big": {"size": 102400, "rcpts": 1, "domains": 1},
    "rcpt5": {"size": 1024, "rcpts": 5, "domains": 5},
}
FIELD_RE = re.compile(r"(\w+)=([^\s]+)")


def parse(line: str) -> dict[str, str]:
    return dict(FIELD_RE.findall(line))


def wait_port_free(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.2)


SYNC_METHOD = "fsync"  # queue.spool.sync_method for Sluice's runs (--sync-method)
RECEIVERS = 0  # smtpd.processes for Sluice's runs (--receivers; 0 = the default)


def run_sluice(n: int, sessions: int, cfg: dict[str, int], quiet_wait: int) -> dict[str, str]:
    work = Path(tempfile.mkdtemp(prefix="sluice-e2e-", dir="/tmp"))
    port, sink_port = 2528, 2526
    config = work / "sluice.yaml"
    config.write_text(
        "node: {hostname: mta.sluice.test, id: bench}\n"
        f"queue: {{path: {work}/queue, spool: {{rootpath: {work}/spool, "
        f"sync_method: {SYNC_METHOD}}}}}\n"
        f"accounting: {{path: {work}/log}}\n"
        f"smtpd: {{listen: ['127.0.0.1:{port}'], processes: {RECEIVERS}}}\n"
        f"delivery: {{transport: {{'*': 'smtp:[127.0.0.1]:{sink_port}'}}}}\n"
        "api: {enabled: false}\n")
    wait_port_free(port)
    proc = subprocess.Popen([SLUICE, "-c", str(config), "serve", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "serving SMTP" not in line:
            raise RuntimeError(f"sluice serve did not start: {line}{proc.stdout.read()}")
        cmd = [sys.executable, str(HARNESS / "e2e_run.py"), "--label", "sluice",
               "--mta-port", str(port), "--sink-port", str(sink_port), "--n", str(n),
               "--sessions", str(sessions), "--rcpts", str(cfg["rcpts"]),
               "--size", str(cfg["size"]), "--domains", str(cfg["domains"]),
               "--mta-pid", str(proc.pid), "--queue-dir", str(work / "spool"),
               "--quiet-wait", str(quiet_wait), "--workdir", str(work / "run")]
        (work / "run").mkdir()
        out = subprocess.run(cmd, cwd=HARNESS, capture_output=True, text=True, timeout=1800)
        last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
        if out.returncode != 0 or not last.startswith("sluice "):
            raise RuntimeError(f"sluice run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        print("   ", last, flush=True)
        return parse(last)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.stdout:
            proc.stdout.close()
        shutil.rmtree(work, ignore_errors=True)


def run_postfix(n: int, sessions: int, cfg: dict[str, int], quiet_wait: int) -> dict[str, str]:
    env = {**os.environ, "QUIET_WAIT": str(quiet_wait)}
    cmd = ["bash", str(HARNESS / "postfix_e2e.sh"), "-n", str(n), "-s", str(sessions),
           "-r", str(cfg["rcpts"]), "-l", str(cfg["size"]), "-d", str(cfg["domains"])]
    wait_port_free(2525)
    out = subprocess.run(cmd, cwd=HARNESS, capture_output=True, text=True, env=env,
                         timeout=1800)
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode != 0 or not last.startswith("postfix "):
        raise RuntimeError(f"postfix run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    print("   ", last, flush=True)
    return parse(last)


def median(runs: list[dict[str, str]], key: str) -> float:
    return statistics.median(float(r[key]) for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--configs", default="base,big,rcpt5")
    ap.add_argument("--no-postfix", action="store_true")
    ap.add_argument("--sync-method", choices=("fsync", "syncfs"), default="fsync",
                    help="Sluice's queue.spool.sync_method (both keep fsync before 250)")
    ap.add_argument("--receivers", type=int, default=0,
                    help="Sluice's smtpd.processes (receiving processes; 0 = one per core but one)")
    ap.add_argument("--quiet-wait", type=int, default=60,
                    help="seconds the harness waits for an idle box before each run")
    args = ap.parse_args()
    if not (HARNESS / "e2e_run.py").exists():
        sys.exit(f"the shared harness is not at {HARNESS}")
    for tool in ("smtp-source", "smtp-sink"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            sys.exit(f"{tool} is missing: apt-get install postfix (scripts/setup does)")
    results: dict[str, dict[str, list[dict[str, str]]]] = {}
    global SYNC_METHOD, RECEIVERS
    SYNC_METHOD = args.sync_method
    RECEIVERS = args.receivers
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        results[name] = {"sluice": [], "postfix": []}
        print(f"== {name}: n={args.n} size={cfg['size']} rcpts={cfg['rcpts']} "
              f"domains={cfg['domains']} sessions={args.sessions}", flush=True)
        for i in range(args.runs):
            order = ["sluice", "postfix"] if i % 2 == 0 else ["postfix", "sluice"]
            for mta in order:
                if mta == "postfix" and args.no_postfix:
                    continue
                runner = run_sluice if mta == "sluice" else run_postfix
                results[name][mta].append(runner(args.n, args.sessions, cfg, args.quiet_wait))
    print()
    print(f"{'config':8} {'MTA':8} {'accept/s':>9} {'e2e/s':>9} {'cpu ms/msg':>10} "
          f"{'contaminated':>12} runs")
    for name, by_mta in results.items():
        for mta, runs in by_mta.items():
            if not runs:
                continue
            cpu = statistics.median(float(r["mta_cpu_s"]) * 1000 / float(r["n"]) for r in runs)
            dirty = sum(int(r.get("contaminated", "0")) for r in runs)
            print(f"{name:8} {mta:8} {median(runs, 'accept_msgs_per_s'):9.0f} "
                  f"{median(runs, 'e2e_msgs_per_s'):9.0f} {cpu:10.2f} {dirty:12d} {len(runs)}")
        if by_mta["postfix"]:
            ratio = (median(by_mta["sluice"], "e2e_msgs_per_s")
                     / median(by_mta["postfix"], "e2e_msgs_per_s"))
            print(f"{name:8} ratio    e2e {ratio:.2f}")
    base = results.get("base") or next(iter(results.values()))
    s = median(base["sluice"], "e2e_msgs_per_s")
    if base["postfix"]:
        p = median(base["postfix"], "e2e_msgs_per_s")
        print(f"sluice_e2e={s:.0f} postfix_e2e={p:.0f} ratio={s / p:.2f}")
    else:
        print(f"sluice_e2e={s:.0f} postfix_e2e=nan ratio=nan")


if __name__ == "__main__":
    main()
