"""Load: where the pipeline's tables and files go.

SUMMARY
    write_table(df, out_dir, name, csv=True) -> dict[str, str]
    write_file(out_dir, name, text) -> str
    rows(df) -> list[dict]          a small table on the driver, times as ISO text
    is_local_dir(path) -> bool

DESCRIPTION
    Every table is written as Parquet (``NAME.parquet/``, for the next
    program) and, when asked, as CSV with a header (``NAME.csv/``, one
    part file, for a person or a spreadsheet).  Both are directories of
    Spark's part files, so the same code writes to a local disk, HDFS or an
    object store.  Files the driver writes itself (the HTML page, the
    policy YAML, the suppression list) need a local directory.

    Existing outputs of the same name are replaced: a job run twice on the
    same input leaves the same result.

SEE ALSO
    sluice.pipeline.jobs
"""

from __future__ import annotations

import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame

__all__ = ["is_local_dir", "join", "rows", "write_file", "write_table"]

#: How times appear in CSV files: the accounting log's own form.
TIME_FORMAT = "yyyy-MM-dd'T'HH:mm:ss.SSSXXX"


def is_local_dir(path: str) -> bool:
    scheme, sep, _ = path.partition("://")
    return not sep or scheme == "file"


def join(out_dir: str, name: str) -> str:
    return out_dir.rstrip("/") + "/" + name


def write_table(df: DataFrame, out_dir: str, name: str, csv: bool = True) -> dict[str, str]:
    """``out_dir/name.parquet`` and ``out_dir/name.csv``; returns their paths."""
    out = {"parquet": join(out_dir, name + ".parquet")}
    df.write.mode("overwrite").parquet(out["parquet"])
    if csv:
        out["csv"] = join(out_dir, name + ".csv")
        (
            # repartition, not coalesce: coalesce(1) would pull the work
            # that produces df into one task as well.
            df.repartition(1)
            .write.mode("overwrite")
            .option("header", True)
            .option("timestampFormat", TIME_FORMAT)
            .csv(out["csv"])
        )
    return out


def write_file(out_dir: str, name: str, text: str) -> str:
    """Write a driver-side file atomically (temporary name, fsync, rename)."""
    if not is_local_dir(out_dir):
        raise ValueError(f"{out_dir}: {name} can only be written to a local directory")
    directory = Path(out_dir.removeprefix("file://"))
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / name
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return str(target)


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        if value.tzinfo is None:  # PySpark hands back local wall time
            value = value.astimezone(UTC)
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    return value


def rows(df: DataFrame) -> list[dict[str, Any]]:
    """A small DataFrame as dicts on the driver (times as ISO 8601 UTC)."""
    return [{k: _plain(v) for k, v in r.asDict().items()} for r in df.collect()]
