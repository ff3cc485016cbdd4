"""What reading every control file of an fs queue costs before any parsing.

usage: python bench/fs_read_floor.py QUEUE_DIR [--rounds 3] [--limit N]

The filesystem flavour keeps one control file per message and recipient
domain, so `sluice qlist` of a million recipients opens, reads and closes
up to a million files. This script times exactly that, nothing else, over
the control files under QUEUE_DIR (the page cache warm after the first
round): from Python (os.open, os.read, os.close, as the listing does) and
from C (cat through xargs, which makes more system calls per file but no
Python). The result is the floor under which no listing of this layout can
go on this machine, printed per file and for the queue as a whole.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path


def control_files(root: Path, limit: int | None) -> list[str]:
    out = []
    for dirpath, _dirs, names in os.walk(root):
        out += [f"{dirpath}/{n}" for n in names if n.endswith(".mmq")]
        if limit is not None and len(out) >= limit:
            return out[:limit]
    return out


def python_round(paths: list[str]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        os.read(fd, 1 << 16)
        os.close(fd)
    return time.perf_counter() - wall, time.process_time() - cpu


def c_round(paths: list[str]) -> float:
    data = "\0".join(paths).encode() + b"\0"
    wall = time.perf_counter()
    subprocess.run(["xargs", "-0", "cat"], input=data, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("queue", type=Path, help="the queue directory (queue.path)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--limit", type=int, default=None, help="at most this many files")
    args = ap.parse_args()
    paths = control_files(args.queue, args.limit)
    if not paths:
        print(f"{args.queue}: no control files (*.mmq) under it")
        return 2
    n = len(paths)
    print(f"{n} control files under {args.queue}; load {os.getloadavg()[0]:.2f}")
    best_py = best_c = float("inf")
    for r in range(args.rounds):
        wall, cpu = python_round(paths)
        c_wall = c_round(paths)
        best_py, best_c = min(best_py, wall), min(best_c, c_wall)
        print(f"  round {r + 1}: python open/read/close {wall / n * 1e6:.1f} us a file "
              f"({cpu / n * 1e6:.1f} us CPU); cat via xargs {c_wall / n * 1e6:.1f} us a file")
    print(f"floor, best round: python {best_py / n * 1e6:.1f} us a file "
          f"({best_py / n * 1e6:.1f} s a million), cat {best_c / n * 1e6:.1f} us a file; "
          f"load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
