#!/usr/bin/env python3
"""End to end: smtp-source -> MTA -> smtp-sink on loopback, Sluice against Postfix.

    .venv/bin/python bench/e2e.py [--runs 5] [--n 20000] [--sessions 20]
                                  [--configs base,big,rcpt5] [--no-postfix]
                                  [--sync-method fsync|syncfs] [--store sqlite|fs|kv]
                                  [--success-sync flush|write]
                                  [--profile DIR] [--pure-too]
                                  [--floor [journal,sqlite,split]]
    .venv/bin/python bench/e2e.py --configs base,many      # 1 vs 10,000 destinations

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
  many   N x 1 KB, 20 sessions, one recipient each, round robin over 10,000
         domains d1.test .. d10000.test, each routed by the MTA's transport
         map to its own next hop 127.10.X.Y:2526 (X = k >> 8, Y = k & 255), so
         that both MTAs keep 10,000 destinations (queues, windows, connection
         pools).  Mail comes from bench/many_inject.py (smtp-source cannot
         spread one process over several domains; this one talks as it does:
         HELO once, no pipelining), the run is driven by bench/many_run.py and
         Postfix by bench/many_postfix.py (transport_maps = hash:, the
         harness's settings otherwise).  One smtp-sink on 0.0.0.0:2526
         receives for all next hops, which is why these configs run in a
         private network namespace holding only lo: when one is chosen, this
         script moves itself (and so everything it starts, the base runs
         too) into a new namespace first.  Needs root.
  many1  the control: the same injector, namespace and routing, one domain
         (d1.test -> 127.10.0.1); many/many1 isolates the cost of the
         destinations from that of the injector

Runs are interleaved (Sluice, Postfix, Sluice, ...; the order alternates)
and the medians of each MTA's runs are compared.  The machine is shared and
noisy (about +-15 %): every run line carries the harness's contamination
figures and the load average (/proc/loadavg) when it started.  The table
gives, per config and MTA, the medians of accept and end-to-end msg/s, the
MTA's CPU per message (all its processes) and the injector's.  With both
base and many chosen it then prints
    sluice_many/sluice_base=X        (the goal: X >= 0.8)
    many ratio vs postfix=Y          (the goal: Y >= 3)
and the last line reads
    sluice_e2e=X postfix_e2e=Y ratio=X/Y
for the base configuration.

--profile DIR adds, after the measured runs of each config, one more Sluice
run (not counted in the medians) under `py-spy record --subprocesses --gil`
(the py-spy of the dev extra) of the serve process and its receivers,
writing DIR/sluice-CONFIG.txt: py-spy's raw collapsed stacks, the input of a
flame graph (flamegraph.pl, speedscope), then a second one writing the flame
graph itself, DIR/sluice-CONFIG.svg.  bench/profile_share.py then
prints the share of the samples spent in sluice/scheduler/ frames -- the
scheduler's share of Sluice's CPU -- and the busiest parts.

--pure-too adds a third MTA to every round, "pure": the same Sluice with
SLUICE_NATIVE=0, so none of the modules mypyc compiled (src/sluice/_native.py)
runs.  The MTAs take turns going first.  The table then also prints
    CONFIG compiled/pure  e2e X  cpu a message Y
the compiled build's median rate and CPU per message over the pure one's.

--floor adds bench/relay_floor.py to every round: a relay that does only
what the 250 promises (the data fdatasync'ed in a journal before it) and
forwards over kept, pipelined sessions, with none of an MTA's queue,
policy or accounting, so its CPU a message is what any Python relay pays
on this machine before doing anything of its own.  --floor journal,sqlite,split
runs it three times a round: "floor" with its journal, "floorsql" keeping
the messages in Sluice's own SQLite schema with the statements of Sluice's
SQLite store (the price of that queue without the code around it), and
"floor2p" receiving in one process and claiming and sending from another
through that queue, as Sluice does (the price of the split).  The table
then also prints, for each,
    CONFIG sluice/floor  e2e X  cpu a message Y
    CONFIG floor/postfix  e2e X  cpu a message Y
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
from collections.abc import Iterator
from pathlib import Path

import many_postfix
import many_routes
import profile_share
from harness import harness_dir

from sluice import _native

HERE = Path(__file__).resolve().parent
HARNESS = harness_dir()
SLUICE = str(Path(sys.executable).parent / "sluice")
PY_SPY = str(Path(sys.executable).parent / "py-spy")
PY_SPY_RATE = 100  # samples per second (see bench/profile_share.py on --gil)

# "hops": each domain its own next hop, the mail from bench/many_inject.py (see above)
CONFIGS: dict[str, dict[str, int]] = {
    "base": {"size": 1024, "rcpts": 1, "domains": 1},
    "big": {"size": 102400, "rcpts": 1, "domains": 1},
    "rcpt5": {"size": 1024, "rcpts": 5, "domains": 5},
    "many": {"size": 1024, "rcpts": 1, "domains": 10000, "hops": 1},
    "many1": {"size": 1024, "rcpts": 1, "domains": 1, "hops": 1},
}
FIELD_RE = re.compile(r"(\w+)=([^\s]+)")


def parse(line: str) -> dict[str, str]:
    return dict(FIELD_RE.findall(line))


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def wait_port_free(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.2)


SYNC_METHOD = "fsync"  # queue.spool.sync_method for Sluice's runs (--sync-method)
RECEIVERS = 0  # smtpd.processes for Sluice's runs (--receivers; 0 = the default)
STORE = "sqlite"  # queue.store for Sluice's runs (--store)
SUCCESS_SYNC = "flush"  # queue.success_sync for Sluice's runs (--success-sync)


def sluice_config(work: Path, port: int, sink_port: int, cfg: dict[str, int]) -> str:
    """Sluice's configuration for one run: everything to the sink, or each domain its hop."""
    if cfg.get("hops"):
        # JSON is YAML: one flow mapping of 10,000 entries, no quoting to get wrong
        transport = json.dumps(many_routes.sluice_transport(cfg["domains"], sink_port))
    else:
        transport = f"{{'*': 'smtp:[127.0.0.1]:{sink_port}'}}"
    return ("node: {hostname: mta.sluice.test, id: bench}\n"
            f"queue: {{path: {work}/queue, store: {STORE}, success_sync: {SUCCESS_SYNC}, "
            f"spool: {{rootpath: {work}/spool, sync_method: {SYNC_METHOD}}}}}\n"
            f"accounting: {{path: {work}/log}}\n"
            f"smtpd: {{listen: ['127.0.0.1:{port}'], processes: {RECEIVERS}}}\n"
            f"delivery: {{transport: {transport}}}\n"
            "api: {enabled: false}\n")


def driver_cmd(label: str, port: int, sink_port: int, n: int, sessions: int,
               cfg: dict[str, int], quiet_wait: int, workdir: Path) -> list[str]:
    """The run's driver: the shared e2e_run.py, or bench/many_run.py for the "hops" mixes."""
    common = ["--label", label, "--mta-port", str(port), "--sink-port", str(sink_port),
              "--n", str(n), "--sessions", str(sessions), "--size", str(cfg["size"]),
              "--domains", str(cfg["domains"]), "--quiet-wait", str(quiet_wait),
              "--workdir", str(workdir)]
    if cfg.get("hops"):
        return [sys.executable, str(HERE / "many_run.py"), *common]
    return [sys.executable, str(HARNESS / "e2e_run.py"), *common, "--rcpts", str(cfg["rcpts"])]


PORT, SINK_PORT = 2528, 2526  # Sluice's and the sink's, for every run


@contextlib.contextmanager
def serving(cfg: dict[str, int], prefix: str = "sluice-e2e-", pure: bool = False
            ) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A `sluice serve` of ``cfg`` on PORT, relaying to SINK_PORT, in a new work directory.

    ``pure``: with SLUICE_NATIVE=0, none of the modules compiled by mypyc
    (src/sluice/_native.py) runs, in serve and in its receivers.

    Yields the process (serving once this returns) and the directory; then
    stops it (SIGTERM, its process group killed after 60 s) and removes
    the directory.
    """
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    config = work / "sluice.yaml"
    config.write_text(sluice_config(work, PORT, SINK_PORT, cfg))
    env = {**os.environ, "SLUICE_NATIVE": "0"} if pure else None
    cmd = [SLUICE, "-c", str(config), "serve", "--log-level", "warning"]
    with running(cmd, work, "sluice serve", env) as proc:
        yield proc, work


@contextlib.contextmanager
def floor_serving(cfg: dict[str, int], options: tuple[str, ...]
                  ) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """bench/relay_floor.py on PORT, relaying to SINK_PORT (each domain its hop for "hops")."""
    work = Path(tempfile.mkdtemp(prefix="floor-e2e-", dir="/tmp"))
    cmd = [sys.executable, str(HERE / "relay_floor.py"), "--listen", f"127.0.0.1:{PORT}",
           "--sink-port", str(SINK_PORT), "--dir", str(work / "store"), *options]
    if cfg.get("hops"):
        cmd.append("--hops")
    with running(cmd, work, "bench/relay_floor.py") as proc:
        yield proc, work


@contextlib.contextmanager
def running(cmd: list[str], work: Path, name: str, env: dict[str, str] | None = None
            ) -> Iterator[subprocess.Popen[str]]:
    """An MTA started by ``cmd`` that prints "serving SMTP" once it listens on PORT.

    Yields it serving; then stops it (SIGTERM, its process group killed
    after 60 s) and removes ``work``.
    """
    wait_port_free(PORT)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "serving SMTP" not in line:
            raise RuntimeError(f"{name} did not start: {line}{proc.stdout.read()}")
        yield proc
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


def drive(proc: subprocess.Popen[str], work: Path, n: int, sessions: int,
          cfg: dict[str, int], quiet_wait: int, label: str = "sluice") -> dict[str, str]:
    """One run of the driver against a serving MTA; its result line's fields.

    Sluice's spool is checked empty afterwards; the floor keeps no spool.
    """
    cmd = driver_cmd(label, PORT, SINK_PORT, n, sessions, cfg, quiet_wait, work / "run")
    cmd += ["--mta-pid", str(proc.pid)]
    if label == "sluice":
        cmd += ["--queue-dir", str(work / "spool")]
    (work / "run").mkdir()
    out = subprocess.run(cmd, cwd=HARNESS, capture_output=True, text=True, timeout=1800)
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode != 0 or not last.startswith(f"{label} "):
        raise RuntimeError(f"{label} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return parse(last)


#: The floors of --floor: the name given, the MTA's name in the table, its options
FLOORS = {"journal": ("floor", ("--store", "journal")),
          "sqlite": ("floorsql", ("--store", "sqlite")),
          "split": ("floor2p", ("--store", "sqlite", "--split"))}
FLOOR_OPTIONS = dict(FLOORS.values())


def run_floor(n: int, sessions: int, cfg: dict[str, int], quiet_wait: int,
              mta: str) -> dict[str, str]:
    """One run of bench/relay_floor.py, the least a Python relay does (its module doc)."""
    with floor_serving(cfg, FLOOR_OPTIONS[mta]) as (proc, work):
        return drive(proc, work, n, sessions, cfg, quiet_wait, label=mta)


def run_sluice(n: int, sessions: int, cfg: dict[str, int], quiet_wait: int,
               profile: Path | None = None, pure: bool = False) -> dict[str, str]:
    """One Sluice run; with `profile`, under py-spy writing raw stacks there."""
    with serving(cfg, pure=pure) as (proc, work):
        spy: subprocess.Popen[bytes] | None = None
        try:
            if profile is not None:
                # the driver's idle wait (5 s at least) lets py-spy attach before the clock starts
                spy = subprocess.Popen(
                    [PY_SPY, "record", "--subprocesses", "--pid", str(proc.pid),
                     "--format", "flamegraph" if profile.suffix == ".svg" else "raw",
                     "--rate", str(PY_SPY_RATE), "--gil", "--output", str(profile)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            return drive(proc, work, n, sessions, cfg, quiet_wait)
        finally:
            if spy is not None:
                stop_py_spy(spy)


def stop_py_spy(spy: subprocess.Popen[bytes]) -> None:
    """Stop a recording as Control-C does, so that py-spy writes its file."""
    if spy.poll() is None:
        spy.send_signal(signal.SIGINT)
    try:
        _, err = spy.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        spy.kill()
        _, err = spy.communicate()
    if spy.returncode != 0:
        print(f"    py-spy exited {spy.returncode}: {err.decode(errors='replace')[-500:]}",
              flush=True)


def run_postfix(n: int, sessions: int, cfg: dict[str, int], quiet_wait: int) -> dict[str, str]:
    if cfg.get("hops"):
        wait_port_free(2525)
        try:
            res = many_postfix.run(n, sessions, cfg["size"], cfg["domains"], quiet_wait)
        except (RuntimeError, subprocess.SubprocessError) as exc:
            raise RuntimeError(f"postfix run failed: {exc}") from exc
        return res
    env = {**os.environ, "QUIET_WAIT": str(quiet_wait)}
    cmd = ["bash", str(HARNESS / "postfix_e2e.sh"), "-n", str(n), "-s", str(sessions),
           "-r", str(cfg["rcpts"]), "-l", str(cfg["size"]), "-d", str(cfg["domains"])]
    wait_port_free(2525)
    out = subprocess.run(cmd, cwd=HARNESS, capture_output=True, text=True, env=env,
                         timeout=1800)
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode != 0 or not last.startswith("postfix "):
        raise RuntimeError(f"postfix run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return parse(last)


def median(runs: list[dict[str, str]], key: str) -> float:
    return statistics.median(float(r[key]) for r in runs)


def cpu_ms(runs: list[dict[str, str]]) -> float:
    """The median of the MTA's CPU milliseconds a message over ``runs``."""
    return statistics.median(float(r["mta_cpu_s"]) * 1000 / float(r["n"]) for r in runs)


def summary(results: dict[str, dict[str, list[dict[str, str]]]],
            shares: dict[str, float]) -> None:
    """The medians per config and MTA, the ratios, and the goal lines (see the module doc)."""
    print()
    print(f"{'config':8} {'MTA':8} {'accept/s':>9} {'e2e/s':>9} {'cpu ms/msg':>10} "
          f"{'src ms/msg':>10} {'load':>5} {'contaminated':>12} runs")
    for name, by_mta in results.items():
        for mta, runs in by_mta.items():
            if not runs:
                continue
            cpu = cpu_ms(runs)
            src = statistics.median(float(r["source_cpu_s"]) * 1000 / float(r["n"])
                                    for r in runs)
            dirty = sum(int(r.get("contaminated", "0")) for r in runs)
            print(f"{name:8} {mta:8} {median(runs, 'accept_msgs_per_s'):9.0f} "
                  f"{median(runs, 'e2e_msgs_per_s'):9.0f} {cpu:10.2f} {src:10.2f} "
                  f"{median(runs, 'load'):5.2f} {dirty:12d} {len(runs)}")
        if by_mta["postfix"] and by_mta["sluice"]:
            ratio = (median(by_mta["sluice"], "e2e_msgs_per_s")
                     / median(by_mta["postfix"], "e2e_msgs_per_s"))
            print(f"{name:8} ratio    e2e {ratio:.2f}")
        if by_mta.get("pure") and by_mta["sluice"]:
            rate = (median(by_mta["sluice"], "e2e_msgs_per_s")
                    / median(by_mta["pure"], "e2e_msgs_per_s"))
            cpu = cpu_ms(by_mta["sluice"]) / cpu_ms(by_mta["pure"])
            print(f"{name:8} compiled/pure  e2e {rate:.2f}  cpu a message {cpu:.2f}")
        for floor in FLOOR_OPTIONS:
            for a, b in (("sluice", floor), (floor, "postfix")):
                if by_mta.get(a) and by_mta.get(b):
                    rate = (median(by_mta[a], "e2e_msgs_per_s")
                            / median(by_mta[b], "e2e_msgs_per_s"))
                    cpu = cpu_ms(by_mta[a]) / cpu_ms(by_mta[b])
                    print(f"{name:8} {a}/{b}  e2e {rate:.2f}  cpu a message {cpu:.2f}")
    for name, share in shares.items():
        print(f"{name:8} scheduler share of Sluice's CPU (py-spy samples) {100 * share:.1f}%")

    def e2e(name: str, mta: str = "sluice") -> float:
        runs = results.get(name, {}).get(mta)
        return median(runs, "e2e_msgs_per_s") if runs else float("nan")

    if "many" in results:
        if "base" in results:
            print(f"sluice_many/sluice_base={e2e('many') / e2e('base'):.2f}")
        if "many1" in results:
            print(f"sluice_many/sluice_many1={e2e('many') / e2e('many1'):.2f}")
        print(f"many ratio vs postfix={e2e('many') / e2e('many', 'postfix'):.2f}")
    base = "base" if "base" in results else next(iter(results))
    print(f"sluice_e2e={e2e(base):.0f} postfix_e2e={e2e(base, 'postfix'):.0f} "
          f"ratio={e2e(base) / e2e(base, 'postfix'):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--configs", default="base,big,rcpt5",
                    help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--no-postfix", action="store_true")
    ap.add_argument("--sync-method", choices=("fsync", "syncfs"), default="fsync",
                    help="Sluice's queue.spool.sync_method (both keep fsync before 250)")
    ap.add_argument("--success-sync", choices=("flush", "write"), default="flush",
                    help="Sluice's queue.success_sync: a success flushed (its default), or "
                         "written as Postfix does, before the connection carries the next")
    ap.add_argument("--receivers", type=int, default=0,
                    help="Sluice's smtpd.processes (receiving processes; 0 = one per core but one)")
    ap.add_argument("--store", choices=("sqlite", "fs", "kv"), default="sqlite",
                    help="Sluice's queue.store (the flavour of its queue)")
    ap.add_argument("--quiet-wait", type=int, default=60,
                    help="seconds the harness waits for an idle box before each run")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="one more Sluice run per config under py-spy; stacks to DIR")
    ap.add_argument("--pure-too", action="store_true",
                    help="each round also runs Sluice with SLUICE_NATIVE=0 (no mypyc build), "
                         "interleaved: MTA 'pure'")
    ap.add_argument("--floor", nargs="?", const="journal", default="",
                    metavar="journal,sqlite,split",
                    help="each round also runs bench/relay_floor.py, the least a Python relay "
                         "does with the same durability: MTA 'floor' (its journal), "
                         "'floorsql' (Sluice's SQLite schema and statements), 'floor2p' (that, "
                         "received in one process and claimed and sent from another)")
    args = ap.parse_args()
    names = args.configs.split(",")
    if unknown := [n for n in names if n not in CONFIGS]:
        ap.error(f"unknown config {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
    if unknown := [f for f in args.floor.split(",") if f and f not in FLOORS]:
        ap.error(f"unknown floor {', '.join(unknown)} (known: {', '.join(FLOORS)})")
    if args.success_sync == "write" and args.store == "fs":
        ap.error("--success-sync write does nothing with --store fs, which flushes every "
                 "change: the runs would be flush's")
    floors = [FLOORS[f][0] for f in args.floor.split(",") if f]
    if not (HARNESS / "e2e_run.py").exists():
        sys.exit(f"the shared harness is not at {HARNESS}")
    src = Path(_native.__file__).resolve().parent.parent
    if os.environ.get(_native.SWITCH) != "0" and (why := _native.stale(src)) is not None:
        sys.exit(f"e2e: the mypyc build is stale ({why}): run {_native.REBUILD}, "
                 f"or set {_native.SWITCH}=0 to measure the pure modules")
    if args.pure_too and not _native.current(src):
        sys.exit(f"e2e: --pure-too compares against a mypyc build, and there is none: "
                 f"run {_native.REBUILD}")
    for tool in ("smtp-source", "smtp-sink"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            sys.exit(f"{tool} is missing: apt-get install postfix (scripts/setup does)")
    if args.profile is not None:
        if not Path(PY_SPY).exists():
            sys.exit(f"{PY_SPY} is missing: pip install the dev extra (py-spy)")
        args.profile.mkdir(parents=True, exist_ok=True)
    if any(CONFIGS[n].get("hops") for n in names):
        try:
            many_routes.enter_private_netns()
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
            sys.exit(f"e2e: {exc}")
        print("# in a private network namespace (interfaces: lo only), for the "
              "many-destinations configs; every run of this sitting is inside", flush=True)
    results: dict[str, dict[str, list[dict[str, str]]]] = {}
    shares: dict[str, float] = {}
    global SYNC_METHOD, RECEIVERS, STORE, SUCCESS_SYNC
    SYNC_METHOD = args.sync_method
    SUCCESS_SYNC = args.success_sync
    RECEIVERS = args.receivers
    STORE = args.store
    for name in names:
        cfg = CONFIGS[name]
        results[name] = {"sluice": [], "pure": [], **{f: [] for f in FLOOR_OPTIONS},
                         "postfix": []}
        print(f"== {name}: n={args.n} size={cfg['size']} rcpts={cfg['rcpts']} "
              f"domains={cfg['domains']} next hops={cfg['domains'] if cfg.get('hops') else 1} "
              f"sessions={args.sessions} sluice success_sync={args.success_sync}", flush=True)
        mtas = (["sluice"] + ["pure"] * args.pure_too + floors
                + ["postfix"] * (not args.no_postfix))
        for i in range(args.runs):
            turn = i % len(mtas)  # each MTA goes first in turn
            for mta in mtas[turn:] + mtas[:turn]:
                load = loadavg()
                if mta == "postfix":
                    res = run_postfix(args.n, args.sessions, cfg, args.quiet_wait)
                elif mta in FLOOR_OPTIONS:
                    res = run_floor(args.n, args.sessions, cfg, args.quiet_wait, mta)
                else:
                    res = run_sluice(args.n, args.sessions, cfg, args.quiet_wait,
                                     pure=mta == "pure")
                res.setdefault("load", load)
                print(f"    {mta} " + " ".join(f"{k}={v}" for k, v in res.items()), flush=True)
                results[name][mta].append(res)
        if args.profile is not None:
            path = args.profile / f"sluice-{name}.txt"
            print(f"-- {name}: one more Sluice run under py-spy (not in the medians) -> {path}",
                  flush=True)
            res = run_sluice(args.n, args.sessions, cfg, args.quiet_wait, profile=path)
            print("    sluice(py-spy) " + " ".join(f"{k}={v}" for k, v in res.items()),
                  flush=True)
            shares[name] = profile_share.report(str(path), rate=PY_SPY_RATE)
            print(f"  the run's MTA CPU in the measured window: {res['mta_cpu_s']} cpu-s",
                  flush=True)
            # py-spy writes one format a run: a second run for the picture
            svg = path.with_suffix(".svg")
            run_sluice(args.n, args.sessions, cfg, args.quiet_wait, profile=svg)
            print(f"  flame graph (a second run, not in the medians): {svg}", flush=True)
    summary(results, shares)


if __name__ == "__main__":
    main()
