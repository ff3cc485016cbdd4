"""Load: where the pipeline's tables and files go.

SUMMARY
    write_table(df, out_dir, name, csv=True, single=False, by_day=None) -> dict[str, str]
    write_file(spark, out_dir, name, text) -> str
    rows(df) -> list[dict]          a small table on the driver, times as ISO text
    is_local_dir(path) -> bool

DESCRIPTION
    Every table is written as Parquet (``NAME.parquet/``, for the next
    program) and, when asked, as CSV with a header (``NAME.csv/``, for a
    person or a spreadsheet).  Both are directories of Spark's part
    files, so the same code writes to a local disk, HDFS or an object
    store.  Tables with a time column are partitioned by day in Parquet
    (``NAME.parquet/day=2026-11-22/``), so a reader of one day reads one
    directory.  Files the driver writes itself (the HTML page, the policy
    YAML) go through sluice.pipeline.hfs: a local path or any URI the
    Hadoop FileSystem knows.

    Existing outputs of the same name are replaced: a job run twice on the
    same input leaves the same result.

STRATEGIES
    One CSV file only where it is small by construction (``single``: the
    totals, the hours, the top reasons, the throttle findings): the one
    task that writes it cannot be big.  Every other table is written by
    as many tasks as computed it.

SEE ALSO
    sluice.pipeline.jobs, sluice.pipeline.hfs
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from sluice.pipeline import hfs

__all__ = ["is_local_dir", "join", "rows", "write_file", "write_table"]

#: How times appear in CSV files: the accounting log's own form.
TIME_FORMAT = "yyyy-MM-dd'T'HH:mm:ss.SSSXXX"


def is_local_dir(path: str) -> bool:
    """Whether ``out_dir`` is a plain local path (see hfs.is_local)."""
    return hfs.is_local(path)


def join(out_dir: str, name: str) -> str:
    """``name`` under the directory or URI ``out_dir``."""
    return out_dir.rstrip("/") + "/" + name


def write_table(df: DataFrame, out_dir: str, name: str, csv: bool = True,
                single: bool = False, by_day: str | None = None) -> dict[str, str]:
    """Write ``out_dir/name.parquet`` and ``out_dir/name.csv``; returns their paths.

    The Parquet is partitioned by the day of ``by_day`` when given; the CSV
    is one part file when ``single``.
    """
    out = {"parquet": join(out_dir, name + ".parquet")}
    if by_day is not None:
        (df.withColumn("day", F.to_date(F.col(by_day)))
         .write.mode("overwrite").partitionBy("day").parquet(out["parquet"]))
    else:
        df.write.mode("overwrite").parquet(out["parquet"])
    if csv:
        out["csv"] = join(out_dir, name + ".csv")
        # repartition, not coalesce: coalesce(1) would pull the work that
        # produces df into one task as well.
        (
            (df.repartition(1) if single else df)
            .write.mode("overwrite")
            .option("header", True)
            .option("timestampFormat", TIME_FORMAT)
            .csv(out["csv"])
        )
    return out


def write_file(spark: SparkSession | None, out_dir: str, name: str, text: str) -> str:
    """Write a driver-side file atomically, to a local directory or any Hadoop URI."""
    return hfs.write_text(spark, join(out_dir, name), text)


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        if value.tzinfo is None:  # PySpark hands back local wall time
            value = value.astimezone(UTC)
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    return value


def rows(df: DataFrame) -> list[dict[str, Any]]:
    """A small DataFrame as dicts on the driver (times as ISO 8601 UTC)."""
    return [{k: _plain(v) for k, v in r.asDict().items()} for r in df.collect()]
