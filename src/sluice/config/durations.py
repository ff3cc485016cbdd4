"""Durations, retry schedules and shares as written in a configuration file.

SUMMARY
    parse_duration("1h30m") -> 5400.0; format_duration(5400) -> "1h30m"
    parse_retry_delays("30m | 2h | 4h") -> (1800.0, 7200.0, 14400.0)
    parse_fraction("20%") -> 0.2

STRATEGY
    Pure functions of one value, raising ValueError with what is wrong;
    the loader turns that into a ConfigError naming the file and key.  A
    duration is seconds (a number) or a string of numbers with the units
    s, m, h and d, alone or combined ("90s", "30m", "1h30m", "3d").
    format_duration is the inverse, for ``sluice config show``: the
    shortest exact spelling, or plain seconds when that reads better.

SEE ALSO
    sluice.config.loader (which calls these), docs/configuration.md
"""

from __future__ import annotations

import re

__all__ = ["format_duration", "parse_duration", "parse_fraction", "parse_retry_delays"]

_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)", re.IGNORECASE)


def parse_duration(value: object) -> float:
    """Seconds from 90, "90s", "30m", "2h", "1d", "1h30m". Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"{value!r} is negative")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a duration")
    text = value.strip()
    pos = 0
    total = 0.0
    if not text:
        raise ValueError("empty duration")
    while pos < len(text):
        m = _DURATION_RE.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"{value!r} is not a duration (use s, m, h or d, e.g. 30m)")
        unit = m.group(2).lower() or "s"
        total += float(m.group(1)) * _UNIT_S[unit]
        pos = m.end()
        while pos < len(text) and text[pos] == " ":
            pos += 1
    return total


def format_duration(seconds: float) -> str:
    """The shortest exact spelling: 1800 -> "30m", 5400 -> "1h30m", 90 -> "90s"."""
    if seconds != int(seconds):
        return f"{seconds:g}s"
    rest = int(seconds)
    if rest == 0:
        return "0s"
    out = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            n, rest = divmod(rest, size)
            out.append(f"{n}{unit}")
    if len(out) > 2:  # "1d2h3m4s" reads worse than seconds
        return f"{int(seconds)}s"
    return "".join(out)


def parse_retry_delays(value: object) -> tuple[float, ...]:
    """Mailismus's "30m | 2h | 4h" (or a YAML list) as seconds."""
    items: list[object]
    if isinstance(value, str):
        items = [part for part in value.split("|")]
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        raise ValueError(f"{value!r} is not a list of delays")
    delays = tuple(
        parse_duration(item.strip() if isinstance(item, str) else item) for item in items
    )
    if not delays:
        raise ValueError("at least one delay is needed")
    if any(d <= 0 for d in delays):
        raise ValueError("every retry delay must be greater than zero")
    return delays


def parse_fraction(value: object) -> float:
    """A share as ``0.2`` or ``"20%"``."""
    if isinstance(value, str) and value.strip().endswith("%"):
        return float(value.strip()[:-1]) / 100
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"{value!r} is not a share (use 0.2 or \"20%\")")
