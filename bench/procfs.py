"""The /proc/PID/stat of every live process, for the benchmarks that add up CPU or memory.

proc_stats() yields (pid, fields) where ``fields`` are the stat fields after
the command name: fields[1] is the parent's pid, fields[2] the process
group, fields[11] and fields[12] utime and stime in clock ticks (proc(5)).
A process that ends while it is read is left out.  stat_fields() reads
those fields from any stat file, a thread's (/proc/PID/task/TID/stat) too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def stat_fields(path: str) -> list[str]:
    """The fields of a stat file after the command name (which may hold spaces)."""
    stat = Path(path).read_text()
    return stat[stat.rindex(")") + 2 :].split()


def proc_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, stat fields after the command name) of every live process."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = stat_fields(f"/proc/{entry}/stat")
        except OSError:
            continue
        yield int(entry), fields
