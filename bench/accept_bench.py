"""Accept throughput of Sluice's receivers: smtp-source -> sluice.smtpd -> SQLite queue.

Postfix's smtp-source sends N messages over S parallel sessions to Sluice
receivers on 127.0.0.1 (1 and 2 processes accepting from one listening
socket that the pool bound), which queue them in the real SQLite store with its spool
(fsync before every 250, group commit).  Nothing is delivered.  For each
run it prints the accepted messages per second and the CPU the receivers
used per message, checks that the queue holds exactly N messages, and ends
with one machine-readable line per configuration.

Modes: ``reuse`` keeps each session's connection for its messages
(smtp-source -d, as the project's e2e harness does); ``connect`` opens a
connection per message (smtp-source's default, the harder case).

    .venv/bin/python bench/accept_bench.py                     # 20000 x 1 KB, 20 sessions
    .venv/bin/python bench/accept_bench.py -n 5000 --processes 2 --modes connect
    .venv/bin/python bench/accept_bench.py --profile /tmp/prof  # py-spy flame graphs

Needs /usr/sbin/smtp-source (Debian package postfix).  Numbers on a shared
2-core machine move by +-15 % and more when other programs run: each run
prints ``foreign_cpu``, the CPU other processes used meanwhile (kernel
threads included), as a share of one core; compare medians of --repeat
runs with little of it.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sluice.config import load_config  # noqa: E402
from sluice.queue import Queue  # noqa: E402
from sluice.smtpd import ReceiverPool  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")
SMTP_SOURCE = shutil.which("smtp-source") or "/usr/sbin/smtp-source"


@dataclass(frozen=True, slots=True)
class Run:
    processes: int
    mode: str
    messages: int
    seconds: float
    receiver_cpu_s: float
    source_cpu_s: float
    box_busy: float  # fraction of all cores busy during the run
    queued: int
    foreign_cpu_s: float  # CPU used by other programs meanwhile (noise)

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    @property
    def cpu_ms_per_msg(self) -> float:
        return self.receiver_cpu_s * 1000 / self.messages


def proc_cpu_s(pid: int, children: bool = True) -> float:
    """utime + stime of ``pid``, with its reaped children's unless told not to."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read().decode("ascii", "replace")
    fields = data[data.rfind(")") + 2 :].split()
    return sum(int(x) for x in fields[11 : 15 if children else 13]) / CLK


def all_cpu_s() -> dict[int, float]:
    """CPU seconds of every process on the box (its own, not its reaped children's:
    those would count a child's whole life when it ends during the run)."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                out[int(name)] = proc_cpu_s(int(name), children=False)
            except (OSError, IndexError, ValueError):
                continue
    return out


def box_ticks() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v), v[3] + v[4]  # total, idle + iowait


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(root: Path, port: int, smtpd: dict[str, object] | None = None) -> Path:
    data = {
        "node": {"hostname": "bench.sluice.test", "id": "bench"},
        "queue": {"path": str(root / "queue"), "spool": {"rootpath": str(root / "spool")}},
        "accounting": {"path": str(root / "log")},
        "smtpd": {
            "listen": [f"127.0.0.1:{port}"],
            "max_connections_per_client": 10000,
            "max_connections": 10000,
            **(smtpd or {}),
        },
    }
    path = root / "sluice.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_once(args: argparse.Namespace, processes: int, mode: str, profile: Path | None) -> Run:
    root = Path(tempfile.mkdtemp(prefix="accept-bench-", dir=args.dir))
    port = free_port()
    cfg_path = write_config(root, port, getattr(args, "smtpd", None))
    pool = ReceiverPool(cfg_path, processes)
    spies: list[subprocess.Popen[bytes]] = []
    try:
        pool.start()
        pids = pool.pids
        # Warm up: the first connections pay for imports and SQLite caches.
        subprocess.run([SMTP_SOURCE, "-s", "2", "-m", "20", "-l", str(args.size), "-f",
                        "from@bench.example", "-t", "to@d1.example", f"127.0.0.1:{port}"],
                       check=True, stdout=subprocess.DEVNULL)
        if profile is not None:
            spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
            for pid in pids:
                out = profile / f"accept-{processes}p-{mode}-{pid}.svg"
                spies.append(subprocess.Popen([spy, "record", "-p", str(pid), "-o", str(out),
                                               "-r", "200"], stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL))
            time.sleep(1.0)
        cmd = [SMTP_SOURCE, "-s", str(args.sessions), "-m", str(args.messages), "-l",
               str(args.size), "-f", "from@bench.example", "-t", "to@d1.example"]
        if args.recipients > 1:
            cmd[1:1] = ["-r", str(args.recipients)]
        if mode == "reuse":
            cmd.insert(1, "-d")
        cmd.append(f"127.0.0.1:{port}")
        everyone0 = all_cpu_s()
        cpu0 = sum(proc_cpu_s(p) for p in pids)
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        box0 = box_ticks()
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - t0
        box1 = box_ticks()
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu1 = sum(proc_cpu_s(p) for p in pids)
        everyone1 = all_cpu_s()
        for spy_proc in spies:
            spy_proc.send_signal(signal.SIGINT)
        for spy_proc in spies:
            spy_proc.wait(30)
    finally:
        pool.stop()
    with Queue.open(load_config(cfg_path)) as queue:
        queued = queue.store.count().messages - 20  # minus the warm-up
    shutil.rmtree(root, ignore_errors=True)
    total = box1[0] - box0[0]
    busy = (total - (box1[1] - box0[1])) / total if total else 0.0
    source_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    ours = {os.getpid(), *pids}
    foreign = sum(cpu - everyone0.get(pid, 0.0) for pid, cpu in everyone1.items()
                  if pid not in ours)  # smtp-source ended before the second look
    return Run(processes, mode, args.messages, seconds, cpu1 - cpu0, source_cpu, busy, queued,
               max(0.0, foreign))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--messages", type=int, default=20000)
    p.add_argument("-s", "--sessions", type=int, default=20)
    p.add_argument("-l", "--size", type=int, default=1024, help="body bytes (smtp-source -l)")
    p.add_argument("-r", "--recipients", type=int, default=1)
    p.add_argument("--processes", default="1,2", help="comma-separated (default %(default)s)")
    p.add_argument("--modes", default="reuse,connect", help="reuse,connect")
    p.add_argument("--repeat", type=int, default=1, help="runs per configuration (median)")
    p.add_argument("--dir", default=None, help="where the queue lives (default: $TMPDIR)")
    p.add_argument("--profile", type=Path, default=None, help="write py-spy flame graphs here")
    args = p.parse_args()
    if not os.path.exists(SMTP_SOURCE):
        print("smtp-source not found (apt-get install postfix)", file=sys.stderr)
        return 1
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    summary = []
    for mode in args.modes.split(","):
        for n in (int(x) for x in args.processes.split(",")):
            runs = []
            for _ in range(args.repeat):
                run = run_once(args, n, mode, args.profile)
                ok = "ok" if run.queued == run.messages * 1 else f"QUEUED {run.queued}!"
                print(f"processes={n} mode={mode:7s} msgs={run.messages} "
                      f"time={run.seconds:6.2f}s rate={run.rate:7.0f} msg/s "
                      f"cpu={run.cpu_ms_per_msg:.3f} ms/msg (receivers) "
                      f"source_cpu={run.source_cpu_s * 1000 / run.messages:.3f} ms/msg "
                      f"box_busy={run.box_busy * 100:.0f}% "
                      f"foreign_cpu={run.foreign_cpu_s / run.seconds * 100:.0f}% of a core "
                      f"queue={ok}", flush=True)
                runs.append(run)
                if run.queued != run.messages:
                    return 1
            summary.append((n, mode, statistics.median(r.rate for r in runs),
                            statistics.median(r.cpu_ms_per_msg for r in runs)))
    for n, mode, rate, cpu in summary:
        print(f"accept processes={n} mode={mode} size={args.size} sessions={args.sessions} "
              f"rcpt={args.recipients} msgs_per_s={rate:.0f} cpu_ms_per_msg={cpu:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
