"""Sendout stages: a campaign's recipient list made ready to inject, as pure transforms.

SUMMARY
    recipients(df, column="email") -> work          the list, one row per input row
    valid_addresses(work) -> work                   RFC 5321/6531 syntax, IDN -> A-labels
    dedupe(work) -> work                            the first row of an address wins
    drop_suppressed(work, listed) -> work           the suppression list's addresses, domains
    check_domains(work, verdicts) -> work           null MX, no MX and no address
    personalise(work, required) -> work             substitutions from the row's fields
    partition_by_domain(work, rows_per_task) -> work
    read_suppression(spark, path, now) -> listed    the list the analytics job writes

DESCRIPTION
    Every stage takes and returns the work frame (WORK_SCHEMA plus, after
    personalise, ``substitutions``): ``row`` (input order), ``input``
    (the address as given), ``fields`` (the row's other columns, a
    struct), ``address`` and ``domain`` (normal form: the local part as
    given, the domain in lower-case A-labels), and ``status`` and
    ``reason``.  A row whose status is null is still to be sent; a stage
    sets a status -- invalid, duplicate, suppressed -- only on such rows,
    so the first reason found is the one reported and no row is lost:
    the outcome table has a line for every input row.

STRATEGIES
    One rule, two engines.  Syntax is sluice.address's regular
    expressions as Spark ``rlike``; the reasons are its texts.  The few
    domains that are not ASCII are turned into A-labels by the ``idna``
    package in a vectorised UDF over the distinct names only, joined
    back (a Python UDF over every row would ship every row to Python).

    Skew.  A campaign's domains are Zipf-like: a third of a list can be
    gmail.com.  partition_by_domain gives a domain with more rows than
    ``rows_per_task`` several buckets (by a hash of the address), so no
    task injects a whole big domain alone, and sorts each partition by
    domain so that a batch sent to the API holds one domain's recipients.

SEE ALSO
    sluice.address, sluice.pipeline.domains (the verdicts),
    sluice.pipeline.injection, sluice.pipeline.sendout_job, docs/analytics.md
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import StringType

from sluice import address as A
from sluice.pipeline.events import utc_instant
from sluice.pipeline.suppress import address as normal_address

__all__ = [
    "DUPLICATE",
    "INVALID",
    "SUPPRESSED",
    "check_domains",
    "dedupe",
    "drop_suppressed",
    "partition_by_domain",
    "personalise",
    "read_suppression",
    "recipients",
    "valid_addresses",
]

INVALID = "invalid"
DUPLICATE = "duplicate"
SUPPRESSED = "suppressed"

#: The columns every stage keeps, besides ``fields`` (the input's other columns).
WORK_COLUMNS = ("row", "input", "fields", "address", "domain", "status", "reason")


def _set(df: DataFrame, cond: Column, status: str, reason: Column | str) -> DataFrame:
    """``status`` and ``reason`` on rows still to send that meet ``cond``."""
    hit = F.col("status").isNull() & F.coalesce(cond, F.lit(False))
    why = reason if isinstance(reason, Column) else F.lit(reason)
    return df.withColumns({
        "reason": F.when(hit, why).otherwise(F.col("reason")),
        "status": F.when(hit, F.lit(status)).otherwise(F.col("status")),
    })


def recipients(df: DataFrame, column: str = "email") -> DataFrame:
    """The input list as the work frame: ``column`` is the address, the rest fields."""
    if column not in df.columns:
        raise ValueError(f"the input has no column {column!r} (it has "
                         f"{', '.join(df.columns) or 'none'}); name it with --address-column")
    others = [c for c in df.columns if c != column]
    fields = F.struct(*[F.col(f"`{c}`") for c in others]) if others else F.struct(
        F.lit(None).cast("string").alias("_none"))
    return df.select(
        F.monotonically_increasing_id().alias("row"),
        F.col(f"`{column}`").cast("string").alias("input"),
        fields.alias("fields"),
        F.lit(None).cast("string").alias("address"),
        F.lit(None).cast("string").alias("domain"),
        F.lit(None).cast("string").alias("status"),
        F.lit(None).cast("string").alias("reason"),
    )


def _a_labels(spark: SparkSession, names: DataFrame) -> DataFrame:
    """Map the distinct non-ASCII domain names to A-labels (a vectorised UDF)."""
    import pandas as pd
    from pyspark.sql.pandas import functions as pandas_functions

    def a_labels(domains: pd.Series) -> pd.Series:
        from sluice.address import a_label

        return domains.map(a_label)

    # Real types, not this module's postponed strings: Spark reads the hints.
    a_labels.__annotations__ = {"domains": pd.Series, "return": pd.Series}
    make: Any = pandas_functions.pandas_udf
    to_a_label: Any = make(a_labels, StringType())

    return names.select("name", to_a_label(F.col("name")).alias("a_label"))


def valid_addresses(work: DataFrame) -> DataFrame:
    """Set address and domain; invalid (with sluice.address's reason) when not a mailbox."""
    text = F.trim(F.coalesce(F.col("input"), F.lit("")))
    text = F.regexp_replace(text, r"^<\s*(.*?)\s*>$", "$1")
    local = F.regexp_extract(text, r"^(.*)@([^@]*)$", 1)
    raw_domain = F.regexp_replace(F.regexp_extract(text, r"^(.*)@([^@]*)$", 2), r"\.$", "")
    staged = work.withColumns({"_local": local, "_raw_domain": raw_domain})
    non_ascii = ~F.col("_raw_domain").rlike(r"^[\x00-\x7F]*$")
    idn = staged.where(non_ascii).select(F.col("_raw_domain").alias("name")).distinct()
    labels = _a_labels(work.sparkSession, idn)
    staged = staged.join(labels, staged["_raw_domain"] == labels["name"], "left")
    domain = F.when(non_ascii, F.col("a_label")).otherwise(F.lower(F.col("_raw_domain")))
    staged = staged.withColumn("_domain", domain).drop("name", "a_label")
    loc, dom = F.col("_local"), F.col("_domain")
    full = F.concat_ws("@", loc, dom)
    checked = staged
    for cond, reason in (
        (~text.contains("@") | (loc == ""), A.NO_AT),
        (~loc.rlike(f"^(?:{A.LOCAL_PART})$") | loc.rlike(r"[\x00-\x1F\x7F]"), A.BAD_LOCAL),
        (F.octet_length(loc) > A.MAX_LOCAL_OCTETS, A.LONG_LOCAL),
        (F.col("_raw_domain").startswith("["), A.LITERAL),
        (dom.isNull(), A.BAD_IDN),
        ((F.length(dom) > A.MAX_DOMAIN_OCTETS) | ~dom.rlike(f"^(?:{A.DOMAIN})$"), A.BAD_DOMAIN),
        (F.octet_length(full) > A.MAX_ADDRESS_OCTETS, A.LONG_ADDRESS),
    ):
        checked = _set(checked, cond, INVALID, reason)
    ok = F.col("status").isNull()
    return checked.withColumns({
        "address": F.when(ok, full),
        "domain": F.when(ok, dom),
    }).select(*work.columns)


def dedupe(work: DataFrame) -> DataFrame:
    """Mark every row of an address (case aside) but the first in input order duplicate."""
    key = F.lower(F.col("address"))
    first = Window.partitionBy(key).orderBy("row")
    ranked = work.withColumn("_rank", F.when(F.col("status").isNull(),
                                             F.row_number().over(first)))
    return _set(ranked, F.col("_rank") > 1, DUPLICATE, "the same address came earlier in the "
                "list").drop("_rank")


def read_suppression(spark: SparkSession, path: str, now: datetime) -> DataFrame:
    """The address and reason of every live entry of the list at ``path``.

    The JSON-lines list or the suppression.parquet table; expired entries
    are left out.
    """
    if path.rstrip("/").endswith(".parquet"):
        raw = spark.read.parquet(path).select(
            "address", "reason", F.col("expires_at").cast("timestamp").alias("expires_at"))
    else:
        schema = "address string, reason string, expires_at string, _corrupt string"
        raw = (spark.read.schema(schema).option("mode", "PERMISSIVE")
               .option("columnNameOfCorruptRecord", "_corrupt").json(path)
               .where(F.col("_corrupt").isNull() & F.col("address").isNotNull())
               .select("address", "reason",
                       F.try_to_timestamp(F.col("expires_at")).alias("expires_at")))
    live = F.col("expires_at").isNull() | (F.col("expires_at") > F.lit(utc_instant(now)))
    return raw.where(live).select(normal_address(F.col("address")).alias("address"),
                                  F.coalesce(F.col("reason"), F.lit("manual")).alias("reason"))


def drop_suppressed(work: DataFrame, listed: DataFrame) -> DataFrame:
    """Mark suppressed the addresses on the list and every address of a listed ``@domain``.

    The reason names the list's reason (hard, soft, manual).
    """
    entries = listed.select(F.col("address").alias("_key"),
                            F.col("reason").alias("_why")).dropDuplicates(["_key"])
    by_address = F.broadcast(entries.where(~F.col("_key").startswith("@")))
    by_domain = F.broadcast(entries.where(F.col("_key").startswith("@"))
                            .withColumnsRenamed({"_key": "_dkey", "_why": "_dwhy"}))
    keyed = work.withColumns({"_a": normal_address(F.col("address")),
                              "_d": F.concat(F.lit("@"), F.col("domain"))})
    joined = (keyed.join(by_address, keyed["_a"] == by_address["_key"], "left")
              .join(by_domain, keyed["_d"] == by_domain["_dkey"], "left"))
    why = F.coalesce(F.col("_why"), F.col("_dwhy"))
    marked = _set(joined, why.isNotNull(),
                  SUPPRESSED, F.concat(F.lit("on the suppression list ("), why, F.lit(")")))
    return marked.select(*work.columns)


def check_domains(work: DataFrame, verdicts: DataFrame) -> DataFrame:
    """Mark invalid the rows whose domain takes no mail, as its ``verdicts`` row says.

    ``verdicts`` has (domain, ok, reason); a domain without a verdict, or
    one that failed only for now, passes.
    """
    bad = F.broadcast(verdicts.where(~F.col("ok")).select(
        F.col("domain").alias("_vd"), F.col("reason").alias("_vr")))
    joined = work.join(bad, work["domain"] == bad["_vd"], "left")
    return _set(joined, F.col("_vr").isNotNull(), INVALID, F.col("_vr")).select(*work.columns)


def personalise(work: DataFrame, required: Iterable[str] = ()) -> DataFrame:
    """Add ``substitutions`` (the row's fields as text) for the template.

    A row is invalid when a field the template needs is empty.  Raises
    ValueError when the input has no such column at all.
    """
    field_names = [f.name for f in work.schema["fields"].dataType.fields  # type: ignore[attr-defined]
                   if f.name != "_none"]
    needed = [n for n in dict.fromkeys(required) if n not in ("email", "name")
              or n in field_names]
    missing = [n for n in needed if n not in field_names]
    if missing:
        raise ValueError(f"the template needs {', '.join(missing)}, which the input does not "
                         f"have (it has {', '.join(field_names) or 'no other column'})")
    pairs: list[Column] = []
    for name in field_names:
        pairs += [F.lit(name), F.col(f"fields.`{name}`").cast("string")]
    subs = F.create_map(*pairs) if pairs else F.create_map().cast("map<string,string>")
    out = work.withColumn("substitutions", subs)
    for name in needed:
        value = F.col(f"fields.`{name}`").cast("string")
        out = _set(out, value.isNull() | (F.trim(value) == ""), INVALID,
                   f"no value for {name}, which the template needs")
    return out


def partition_by_domain(work: DataFrame, rows_per_task: int = 5000,
                        total: int | None = None) -> DataFrame:
    """Partitions of about ``rows_per_task`` rows, one domain's rows together.

    A big domain spreads over several; rows are sorted by domain within
    each.  ``total`` is the number of rows when the caller knows it (else it
    is counted).
    """
    if rows_per_task < 1:
        raise ValueError("rows_per_task must be at least 1")
    per_domain = work.groupBy("domain").agg(F.count(F.lit(1)).alias("_n"))
    sized = work.join(F.broadcast(per_domain), "domain", "left")
    buckets = F.greatest(F.lit(1), F.ceil(F.col("_n") / F.lit(rows_per_task)))
    key = F.concat_ws("#", F.col("domain"),
                      F.pmod(F.xxhash64(F.lower(F.col("address"))), buckets).cast("string"))
    rows = work.count() if total is None else total
    parts = max(1, -(-rows // rows_per_task))
    return (sized.withColumn("_bucket", key).repartition(parts, "_bucket")
            .sortWithinPartitions("domain", "row").drop("_bucket", "_n")
            .select(*work.columns))

