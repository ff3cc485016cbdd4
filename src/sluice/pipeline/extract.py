"""Extract: the accounting log (JSON lines or Parquet) and Postfix maillogs as DataFrames.

SUMMARY
    expand_inputs(patterns) -> list[str]
    read_events(spark, paths, extra=None) -> DataFrame (EVENT_SCHEMA [+ extra])
    read_lines(spark, paths) -> DataFrame (value: string)

DESCRIPTION
    Inputs are local paths, shell-style globs (``var/log/sluice-acct-2026*``,
    ``**`` included) or URIs that Spark reads itself (``hdfs://``, ``s3a://``,
    ...; globs in those are Spark's to expand).  A path ending in
    ``.parquet``, or a directory holding Parquet part files, is read as
    Parquet; everything else as JSON lines.

    JSON lines are read with the explicit RAW_EVENT_SCHEMA, never by
    inference: inference costs a pass over the data and guesses types from
    whatever came first.  A line that is not JSON lands in the corrupt-record
    column and is dropped by normalise_events().

INVARIANTS
    What read_events() returns has exactly EVENT_SCHEMA, whatever the input
    format, so every transformation downstream sees one shape; followed by
    the ``extra`` fields when asked (an ingested table's stored columns,
    null where an input has none).

SEE ALSO
    sluice.pipeline.events (normalisation), sluice.pipeline.schema
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
from functools import reduce
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from sluice.pipeline.events import conform_events, normalise_events
from sluice.pipeline.schema import CORRUPT_COLUMN, RAW_EVENT_SCHEMA

__all__ = ["InputError", "expand_inputs", "is_parquet", "read_events", "read_lines"]


class InputError(Exception):
    """An input path names nothing; str() is the line to print."""


def _is_uri(path: str) -> bool:
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.isalnum() and scheme != "file"


def expand_inputs(patterns: Iterable[str]) -> list[str]:
    """Expand local globs; keep URIs for Spark.  Raises InputError on no match."""
    out: list[str] = []
    for pattern in patterns:
        if _is_uri(pattern):
            out.append(pattern)
            continue
        local = os.path.expanduser(pattern.removeprefix("file://"))
        matches = sorted(glob.glob(local, recursive=True))
        if not matches:
            raise InputError(f"{pattern}: no such file (or the pattern matches nothing)")
        out.extend(os.path.abspath(m) for m in matches)
    # The same file named twice would be counted twice.
    return list(dict.fromkeys(out))


def is_parquet(path: str) -> bool:
    """Whether ``path`` is Parquet: a ``.parquet`` name, or a local directory of Parquet files.

    A table partitioned by day, as ingest writes it, has its files one level
    down.
    """
    if path.rstrip("/").endswith(".parquet"):
        return True
    if _is_uri(path):
        return False
    p = Path(path)
    # (A table partitioned by day, as ingest writes it, has its files one level down.)
    return p.is_dir() and (any(p.glob("*.parquet")) or any(p.glob("*=*/*.parquet")))


def read_events(spark: SparkSession, paths: Iterable[str],
                extra: StructType | None = None) -> DataFrame:
    """Events from JSON-lines and Parquet inputs, normalised to EVENT_SCHEMA (+ ``extra``)."""
    paths = list(paths)
    if not paths:
        raise InputError("no input files")
    parquet = [p for p in paths if is_parquet(p)]
    jsonl = [p for p in paths if p not in parquet]
    frames: list[DataFrame] = []
    if jsonl:
        raw = (
            spark.read.schema(RAW_EVENT_SCHEMA)
            .option("mode", "PERMISSIVE")
            .option("columnNameOfCorruptRecord", CORRUPT_COLUMN)
            .json(jsonl)
        )
        frames.append(normalise_events(raw, extra))
    if parquet:
        frames.append(conform_events(spark.read.parquet(*parquet), extra))
    return reduce(lambda a, b: a.unionByName(b), frames)


def read_lines(spark: SparkSession, paths: Iterable[str]) -> DataFrame:
    """Text files as one row per line (column ``value``), e.g. a maillog."""
    paths = list(paths)
    if not paths:
        raise InputError("no input files")
    return spark.read.text(paths).select(F.col("value"))
