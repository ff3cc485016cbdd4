#!/usr/bin/env python3
"""Where a process's CPU goes inside compiled code: a perf call graph, summed by function.

    perf record -F 499 --call-graph dwarf -p PID -o perf.data -- sleep 6
    perf script -i perf.data > perf.txt
    .venv/bin/python bench/perf_tree.py perf.txt [--match CPyDef_] [--top 40]
    .venv/bin/python bench/perf_tree.py perf.txt --under CPyDef_encoder___DataEncoder___feed

DESCRIPTION
    py-spy reads Python frames, so it sees nothing of the modules mypyc
    compiles (sluice._native): their samples stop at the last interpreted
    frame (`serve` for most of the queue manager).  perf sees them as C
    functions, named CPyDef_<module>___<function> (and CPyPy_ for the
    entry from Python); with --call-graph dwarf it also unwinds through
    the interpreter and the kernel.

    Without --under it prints, for every function whose name holds
    --match, the share of all samples in which it is on the stack
    ("inclusive", each sample counted once) and the share in which it is
    the innermost matching frame ("own": its own code and the library or
    kernel code it calls directly).  With --under FUNCTION it splits that
    function's samples by the next matching frame inside it, or by the
    leaf when none is.

    The input is what `perf script` prints: a header line per sample,
    then one indented line per frame, innermost first, then a blank line.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from collections.abc import Iterable, Iterator

_OFFSET = re.compile(r"\+0x[0-9a-f]+$")


def samples(lines: Iterable[str]) -> Iterator[list[str]]:
    """Each sample's frames, innermost first, as function names (samples without any skipped)."""
    frames: list[str] | None = None
    for line in lines:
        if not line.strip():
            if frames:
                yield frames
            frames = None
        elif not line[0].isspace():
            frames = []
        elif frames is not None:
            parts = line.split(None, 1)
            if len(parts) == 2:  # "ADDR SYMBOL+OFF (DSO)"
                frames.append(_OFFSET.sub("", parts[1].rsplit(" (", 1)[0]))
    if frames:
        yield frames


def inclusive(stacks: list[list[str]], match: str) -> list[tuple[str, int, int]]:
    """(function, samples with it on the stack, samples with it innermost), busiest first."""
    on: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    for frames in stacks:
        hits = [f for f in frames if match in f]
        on.update(set(hits))
        if hits:
            own[hits[0]] += 1
    return [(f, n, own[f]) for f, n in on.most_common()]


def under(stacks: list[list[str]], function: str, match: str) -> collections.Counter[str]:
    """``function``'s samples by the next frame holding ``match`` inside it, else the leaf."""
    split: collections.Counter[str] = collections.Counter()
    for frames in stacks:
        at = [i for i, f in enumerate(frames) if f == function]
        if not at:
            continue
        inside = frames[:max(at)]  # innermost first, below its outermost call
        nxt = next((f for f in reversed(inside) if match in f and f != function), None)
        split[nxt if nxt is not None else "(own) " + (inside[0] if inside else function)] += 1
    return split


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", help="what `perf script` printed ('-': standard input)")
    ap.add_argument("--match", default="CPyDef_", help="which functions count (a substring)")
    ap.add_argument("--under", help="split this function's samples by what it calls")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    try:
        with (open(args.file) if args.file != "-" else sys.stdin) as fh:
            stacks = list(samples(fh))
    except OSError as exc:
        print(f"perf_tree: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    total = len(stacks)
    if not total:
        print(f"perf_tree: no samples in {args.file} (is it `perf script` output?)",
              file=sys.stderr)
        return 2
    print(f"{total} samples")
    if args.under:
        split = under(stacks, args.under, args.match)
        print(f"{args.under}: {sum(split.values()) / total:.1%} of all")
        for name, n in split.most_common(args.top):
            print(f"{n / total:7.1%}  {name}")
        return 0
    print(" inclusive    own  function")
    for name, n, own in inclusive(stacks, args.match)[:args.top]:
        print(f"{n / total:9.1%} {own / total:6.1%}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
