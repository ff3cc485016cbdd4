#!/usr/bin/env python3
"""The scheduler's share of Sluice's CPU, from a py-spy recording in raw (collapsed stack) form.

    .venv/bin/python bench/profile_share.py FILE.txt [--part sluice/scheduler/] [--top 12]
                                                     [--rate 100]

FILE.txt is what `py-spy record --subprocesses --format raw` writes (bench/e2e.py
--profile DIR records one per config): one line per distinct stack,
`frame;frame;...;frame COUNT`, the outermost frame first; with
--subprocesses each stack starts with `process PID:"cmdline"` frames, the
last of which is the process the sample was taken in.  The same file is a
flame graph's input: flamegraph.pl FILE.txt > f.svg, or open it in
speedscope.

What a sample means: bench/e2e.py records with --gil, so a sample is taken
of a thread only while it holds the GIL, i.e. runs Python code (one thread
per process at a time), and the shares are shares of Python CPU time.
Without --gil py-spy drops the threads it finds idle, but it counts a
runnable thread that waits for a CPU as busy: on a loaded machine (this
one, shared by other jobs) such samples of executor threads waiting in
their queue's get() were most of the recording, five times the MTA's CPU
time.  The GIL's blind spot is CPU spent in C without it (sqlite, the
kernel's side of send, recv and fsync), which is not sampled: the share of
a pure-Python part such as the scheduler is, if anything, overstated.
samples / rate, printed, is the Python CPU time sampled; compare it with
the MTA's CPU time of the run.

Printed:
  * samples in all, in the queue manager (the recorded root process, which
    runs the scheduler) and in the receiving processes;
  * the share of samples with at least one frame in PART (default
    sluice/scheduler/: the scheduler, inclusive of what it calls), of all
    samples and of the queue manager's;
  * the busiest parts, each sample charged to its innermost Sluice module's
    package (sluice/delivery/, sluice/store/, ...) or, with no Sluice frame,
    to the library of its innermost frame (asyncio, sqlite3, ...);
  * last, `scheduler_share=X%` (of all samples).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

FILE_RE = re.compile(r"\(([^()]*):\d+\)$")
# A command line may hold ";" (python -c "...; ..."), so process frames are cut off whole.
PROCESSES_RE = re.compile(r'((?:process \d+:"[^"]*"(?:;|$))*)(.*)')


@dataclass
class Profile:
    """Sample counts of one recording: in all, per process, in PART, per part."""

    total: int = 0
    by_process: Counter[str] = field(default_factory=Counter)
    in_part: Counter[str] = field(default_factory=Counter)  # per process
    by_part: Counter[str] = field(default_factory=Counter)
    root: str = ""  # the first process seen at the top of a stack: the recorded one

    def share(self, process: str | None = None) -> float:
        """Share of samples in PART, of all or of one process's."""
        if process is None:
            n, k = self.total, sum(self.in_part.values())
        else:
            n, k = self.by_process[process], self.in_part[process]
        return k / n if n else float("nan")


def part_of(frame: str) -> str:
    """The part a frame belongs to: sluice/<package>/ or its top-level library."""
    m = FILE_RE.search(frame)
    path = m.group(1) if m else ""
    i = path.rfind("sluice/")
    if i >= 0:
        rest = path[i + len("sluice/"):]
        return "sluice/" + (rest.split("/", 1)[0] + "/" if "/" in rest else rest)
    return path.split("/", 1)[0] if "/" in path else path or "?"


def read(lines: list[str], part: str = "sluice/scheduler/") -> Profile:
    """Count the samples of py-spy raw output lines."""
    prof = Profile()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        m = PROCESSES_RE.match(stack)
        assert m is not None  # the pattern matches any string
        procs = re.findall(r"process (\d+):", m.group(1))
        proc = procs[-1] if procs else "?"
        if procs and not prof.root:
            prof.root = procs[0]
        code = m.group(2).split(";") if m.group(2) else []
        prof.total += n
        prof.by_process[proc] += n
        if any(part in f for f in code):
            prof.in_part[proc] += n
        innermost = next((f for f in reversed(code) if "sluice/" in f), code[-1] if code else "")
        prof.by_part[part_of(innermost)] += n
    return prof


def report(path: str, part: str = "sluice/scheduler/", top: int = 12,
           rate: float = 100.0) -> float:
    """Print the shares of one recording (see the module doc); return PART's share."""
    with open(path) as f:
        prof = read(f.readlines(), part)
    if not prof.total:
        print(f"profile {path}: no samples")
        return float("nan")
    manager = prof.by_process[prof.root]
    print(f"profile {path}: {prof.total} samples ({prof.total / rate:.1f} s at {rate:g}/s); "
          f"queue manager ({prof.root}) {manager}, receiving processes {prof.total - manager}")
    print(f"  {part}: {100 * prof.share():.1f}% of all samples, "
          f"{100 * prof.share(prof.root):.1f}% of the queue manager's")
    busiest = ", ".join(f"{name} {100 * n / prof.total:.1f}%"
                        for name, n in prof.by_part.most_common(top))
    print(f"  by innermost part: {busiest}")
    return prof.share()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--part", default="sluice/scheduler/",
                    help="path fragment of the frames to count (default: sluice/scheduler/)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--rate", type=float, default=100.0, help="py-spy's --rate of the recording")
    a = ap.parse_args()
    try:
        share = report(a.file, a.part, a.top, a.rate)
    except OSError as exc:
        sys.exit(f"profile_share: {exc}")
    print(f"scheduler_share={100 * share:.1f}%")


if __name__ == "__main__":
    main()
