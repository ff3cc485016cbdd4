"""The suppression list file, merged and written by Spark: no entry passes through the driver.

SUMMARY
    read_list(spark, path) -> DataFrame (LIST_SCHEMA) | None     the list as it is
    merge_lists(old, found, delivered, now) -> DataFrame          sluice.suppression.merge_entries
    write_list(spark, entries, path, generated_at) -> int          header + JSON lines, one file

DESCRIPTION
    A sending platform's list holds millions of addresses; collecting it
    on the driver to merge it would make the driver the limit.  Here the
    old list is read by Spark's JSON reader, merged with the new findings
    by a full outer join on the address, and written by one task as one
    file in the format sluice.suppression reads (a header line with the
    count, then one JSON object per entry, sorted by address), then moved
    over the old file atomically (sluice.pipeline.hfs).

    merge_lists follows sluice.suppression.merge_entries rule by rule
    (the reference; a test holds the two to the same answers):

    - old entries that expired by ``now`` go;
    - old hard and soft entries go when the address was delivered to after
      the entry's last failure; manual entries stay whatever happens;
    - a new entry for a listed address replaces it with the earlier
      first_at, except that a manual entry is kept and a hard one is not
      weakened to soft (it only takes the new last_at).

SEE ALSO
    sluice.suppression (the format, the reader, the reference merge),
    sluice.pipeline.suppress (the findings)
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from sluice.pipeline import hfs
from sluice.pipeline.suppress import address as normal_address
from sluice.suppression import FORMAT, VERSION, SuppressionFileError

__all__ = ["LIST_SCHEMA", "merge_lists", "read_list", "write_list"]

#: The entries of a list file as Spark reads them (times as timestamps).
LIST_SCHEMA = (
    "address string, reason string, category string, code int, enhanced string, "
    "response string, first_at timestamp, last_at timestamp, count long, expires_at timestamp"
)

_RAW = (
    "address string, reason string, category string, code int, enhanced string, "
    "response string, first_at string, last_at string, count long, expires_at string, "
    "format string, _corrupt string"
)

#: Times as the list writes them (sluice.accounting.iso_time), in UTC.
_TIME = "yyyy-MM-dd'T'HH:mm:ss.SSS'Z'"


def read_list(spark: SparkSession, path: str) -> DataFrame | None:
    """The entries of the list at ``path``; None when there is no file yet.

    A line that is neither JSON, a comment nor blank raises
    SuppressionFileError.
    """
    if not hfs.exists(spark, path):
        return None
    raw = (spark.read.schema(_RAW).option("mode", "PERMISSIVE")
           .option("columnNameOfCorruptRecord", "_corrupt").json(path))
    # (A corrupt line has every other column null; naming one of them is what
    # Spark asks of a query on the corrupt-record column.)
    bad = raw.where(F.col("_corrupt").isNotNull() & F.col("address").isNull()
                    & ~F.trim(F.col("_corrupt")).startswith("#")).count()
    if bad:
        raise SuppressionFileError(path, 0, f"{bad} line(s) are not JSON entries")
    entries = raw.where(F.col("_corrupt").isNull() & F.col("format").isNull()
                        & F.col("address").isNotNull())
    return entries.select(
        normal_address(F.col("address")).alias("address"),
        F.coalesce(F.col("reason"), F.lit("manual")).alias("reason"),
        F.coalesce(F.col("category"), F.lit("")).alias("category"),
        F.col("code"),
        F.coalesce(F.col("enhanced"), F.lit("")).alias("enhanced"),
        F.coalesce(F.col("response"), F.lit("")).alias("response"),
        *[F.try_to_timestamp(F.col(c)).alias(c) for c in ("first_at", "last_at")],
        F.coalesce(F.col("count"), F.lit(1)).alias("count"),
        F.try_to_timestamp(F.col("expires_at")).alias("expires_at"),
    )


def _live(prefix: str, now: datetime) -> Column:
    expires = F.col(f"{prefix}expires_at")
    return expires.isNull() | (expires > F.lit(now))


def merge_lists(old: DataFrame | None, found: DataFrame, delivered: DataFrame,
                now: datetime) -> DataFrame:
    """The list after a run (LIST_SCHEMA).

    ``found`` has SUPPRESSION_SCHEMA, ``delivered`` (address, delivered_at)
    the last delivery per address.
    """
    at = now if now.tzinfo else now.replace(tzinfo=UTC)
    cols = [c.split()[0] for c in LIST_SCHEMA.split(", ")]
    new = found.select(*[F.col(c).cast(t) for c, t in
                         (c.split() for c in LIST_SCHEMA.split(", "))]).where(_live("", at))
    if old is None:
        return new
    ok = delivered.select(F.col("address").alias("_a"), F.col("delivered_at"))
    kept = old.where(_live("", at)).join(ok, F.col("address") == F.col("_a"), "left")
    worked = F.col("delivered_at").isNotNull() & (
        F.col("last_at").isNull() | (F.col("delivered_at") > F.col("last_at")))
    kept = kept.where((F.col("reason") == "manual") | ~worked).select(*cols)
    o = kept.select(*[F.col(c).alias(f"o_{c}") for c in cols])
    n = new.select(*[F.col(c).alias(f"n_{c}") for c in cols])
    both = o.join(n, F.col("o_address") == F.col("n_address"), "full_outer")
    only_old = F.col("n_address").isNull()
    only_new = F.col("o_address").isNull()
    keep_old = F.col("o_reason") == "manual"
    harden = (F.col("o_reason") == "hard") & (F.col("n_reason") == "soft")
    out = []
    for c in cols:
        if c == "first_at":
            from_new = F.least(F.col("o_first_at"), F.col("n_first_at"))
        elif c == "last_at":
            from_new = F.col("n_last_at")
        else:
            from_new = F.col(f"n_{c}")
        old_hardened = (F.coalesce(F.col("n_last_at"), F.col("o_last_at")) if c == "last_at"
                        else F.col(f"o_{c}"))
        value = (F.when(only_old, F.col(f"o_{c}")).when(only_new, F.col(f"n_{c}"))
                 .when(keep_old, F.col(f"o_{c}")).when(harden, old_hardened)
                 .otherwise(from_new))
        out.append(value.alias(c))
    return both.select(*out)


def _time(col: str) -> Column:
    return F.date_format(F.col(col), _TIME)


def write_list(spark: SparkSession, entries: DataFrame, path: str,
               generated_at: datetime) -> int:
    """Replace the list at ``path`` with ``entries`` (LIST_SCHEMA); returns the count."""
    count = entries.count()
    stamp = generated_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + \
        f"{generated_at.microsecond // 1000:03d}Z"
    header = spark.createDataFrame(
        [("", f'{{"format":"{FORMAT}","version":{VERSION},"generated_at":"{stamp}",'
              f'"entries":{count}}}')], "_key string, value string")
    body = F.to_json(F.struct(
        "address", "reason", "category", "code", "enhanced", "response",
        _time("first_at").alias("first_at"), _time("last_at").alias("last_at"), "count",
        _time("expires_at").alias("expires_at")), {"ignoreNullFields": "false"})
    lines = header.unionByName(entries.select(F.col("address").alias("_key"),
                                              body.alias("value")))
    tmp = f"{path}.{uuid.uuid4().hex}.parts"
    lines.orderBy("_key").select("value").coalesce(1).write.text(tmp)
    hfs.replace_with_part(spark, tmp, path)
    return count
