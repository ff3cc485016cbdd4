"""What smtpd.dedupe costs the receivers: accept throughput with it off and on.

Runs bench/accept_bench.py's measurement (Postfix's smtp-source -> Sluice
receivers -> the real SQLite queue, fsync before every 250) alternately
with ``smtpd.dedupe`` false and true, the same number of times each,
interleaved so that both see the same machine.  smtp-source gives every
message its own Message-Id, so with dedupe on every message is marked and
claimed in the index (one synced SQLite write each) and none is a
duplicate: this is the cost of the check, not the saving of a resend.
Prints each run, the medians, the ratio on/off, and the machine's load
(/proc/loadavg) before and after.

    .venv/bin/python bench/dedupe_bench.py                   # 5 x 5000 x 1 KB, 20 sessions
    .venv/bin/python bench/dedupe_bench.py --repeat 7 -n 10000 --processes 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import accept_bench


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--messages", type=int, default=5000)
    p.add_argument("-s", "--sessions", type=int, default=20)
    p.add_argument("-l", "--size", type=int, default=1024)
    p.add_argument("-r", "--recipients", type=int, default=1)
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--mode", default="reuse", choices=["reuse", "connect"])
    p.add_argument("--repeat", type=int, default=5, help="runs of each (median; at least 5)")
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    args.repeat = max(5, args.repeat)
    print(f"load before: {load()}", flush=True)
    rates: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.repeat):
        for on in ((False, True) if i % 2 == 0 else (True, False)):
            args.smtpd = {"dedupe": on}
            run = accept_bench.run_once(args, args.processes, args.mode, None)
            if run.queued != run.messages:
                print(f"dedupe={on}: queued {run.queued} of {run.messages}!", file=sys.stderr)
                return 1
            rates[on].append(run.rate)
            cpu[on].append(run.cpu_ms_per_msg)
            print(f"dedupe={on!s:5s} rate={run.rate:7.0f} msg/s "
                  f"cpu={run.cpu_ms_per_msg:.3f} ms/msg (receivers) "
                  f"foreign_cpu={run.foreign_cpu_s / run.seconds * 100:.0f}% of a core "
                  f"load={load()}", flush=True)
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"load after: {load()}")
    print(f"dedupe processes={args.processes} mode={args.mode} msgs={args.messages} "
          f"size={args.size} sessions={args.sessions} runs={args.repeat} "
          f"off_msgs_per_s={off:.0f} on_msgs_per_s={on:.0f} ratio_on_off={on / off:.2f} "
          f"cpu_ms_per_msg off={statistics.median(cpu[False]):.3f} "
          f"on={statistics.median(cpu[True]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
