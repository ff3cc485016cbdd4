"""`sluice sendout`: read a recipient list, clean it, inject it, write what became of each row.

SUMMARY
    run_sendout(spark, inputs, output, template=..., job=..., sender=..., ...) -> JobResult
    load_template(spark, path) -> (content for the API, fields it needs)

DESCRIPTION
    Extract: the list as CSV (with a header), JSON lines or Parquet, from
    any path Spark reads.  Transform: sluice.pipeline.sendout's stages in
    order -- addresses, dedupe, suppression list, optional domain check,
    personalise, partition by domain.  Load: the rows still to send go to
    the injection API from the executors (sluice.pipeline.injection);
    every input row ends as one row of ``OUTPUT/outcomes.parquet``
    (queued, refused, invalid, duplicate, suppressed; with a dry run
    ``ready`` instead of queued/refused), and a summary goes to the
    terminal and to ``OUTPUT/sendout.html``.

STRATEGIES
    One pass of injection.  The cleaned rows are checkpointed on the
    executors once (a row count and the injection both read them), and
    the outcome table is written by the same Spark job that injects, so
    each recipient is posted once per run; a rerun posts again, and the
    API's idempotency keys (job id + address) answer it with the first
    queue ids.

    Progress from accumulators: each batch adds to ``injected``,
    ``queued`` and ``refused`` on its task, and the driver shows the sums
    (Spark sends them as tasks end) with the rate.

SEE ALSO
    sluice.pipeline.sendout, sluice.pipeline.injection, sluice.cli.sendout_cmds,
    docs/analytics.md
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import jinja2
import jinja2.meta
import yaml
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from sluice.pipeline import hfs
from sluice.pipeline.domains import DnsSettings, verdicts
from sluice.pipeline.extract import InputError, expand_inputs
from sluice.pipeline.injection import OUTCOME_SCHEMA, InjectTarget, inject_partition
from sluice.pipeline.jobs import JobResult
from sluice.pipeline.load import join
from sluice.pipeline.sendout import (
    check_domains,
    dedupe,
    drop_suppressed,
    partition_by_domain,
    personalise,
    read_suppression,
    recipients,
    valid_addresses,
)
from sluice.pipeline.sendout_html import render_sendout

__all__ = ["STATUSES", "load_template", "read_list", "run_sendout"]

#: Every status an outcome row can have, in the summary's order.
STATUSES = ("queued", "ready", "refused", "invalid", "duplicate", "suppressed")

_TEMPLATE_KEYS = {"from": "from", "subject": "subject", "text": "text_body",
                  "html": "html_body", "headers": "headers"}


def load_template(spark: SparkSession, path: str) -> tuple[dict[str, Any], set[str]]:
    """The template file as the API's template content, and the substitutions it uses.

    The file is YAML: from, subject, text, html, headers.  Raises ValueError.
    """
    text = hfs.read_text(spark, path)
    if text is None:
        raise InputError(f"{path}: no such template file")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a template is a mapping of from, subject, text, html, headers")
    unknown = sorted(set(data) - set(_TEMPLATE_KEYS))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}; "
                         f"use {', '.join(_TEMPLATE_KEYS)}")
    for key in ("from", "subject"):
        if not isinstance(data.get(key), str):
            raise ValueError(f"{path}: {key} is required (text)")
    if not (data.get("text") or data.get("html")):
        raise ValueError(f"{path}: text, html or both are required")
    headers = data.get("headers") or {}
    if not isinstance(headers, dict):
        raise ValueError(f"{path}: headers is a mapping of name to value")
    content: dict[str, Any] = {_TEMPLATE_KEYS[k]: v for k, v in data.items() if k != "headers"}
    content["headers"] = {str(k): str(v) for k, v in headers.items()}
    env = jinja2.Environment()
    used: set[str] = set()
    sources = [content.get(k) or "" for k in ("from", "subject", "text_body", "html_body")]
    for source in [*sources, *content["headers"].values()]:
        try:
            used |= jinja2.meta.find_undeclared_variables(env.parse(str(source)))
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"{path}: template syntax, line {exc.lineno}: {exc.message}"
                             ) from None
    return content, used


def read_list(spark: SparkSession, paths: Sequence[str], fmt: str | None = None) -> DataFrame:
    """The recipient list: CSV with a header, JSON lines, or Parquet.

    By --format or the first path's extension; CSV otherwise.
    """
    kind = fmt or ""
    if not kind:
        first = paths[0].rstrip("/").lower()
        kind = ("parquet" if first.endswith(".parquet") else
                "json" if first.endswith((".json", ".jsonl", ".ndjson")) else "csv")
    if kind == "csv":
        return spark.read.option("header", True).option("encoding", "UTF-8").csv(list(paths))
    if kind == "json":
        return spark.read.json(list(paths))
    if kind == "parquet":
        return spark.read.parquet(*paths)
    raise ValueError(f"unknown list format {kind!r}: csv, json or parquet")


def _counters(spark: SparkSession) -> dict[str, Any]:
    sc = spark.sparkContext
    return {name: sc.accumulator(0) for name in ("injected", "queued", "refused")}


def run_sendout(
    spark: SparkSession,
    inputs: Sequence[str],
    output: str,
    *,
    template: str,
    job: str,
    sender: str,
    tenant: str = "",
    api_url: str = "http://127.0.0.1:8025",
    token: str = "",
    address_column: str = "email",
    fmt: str | None = None,
    suppression: str | None = None,
    dns: DnsSettings | None = None,
    domain_cache: str | None = None,
    priority: int = 0,
    batch_size: int = 100,
    concurrency: int = 4,
    rows_per_task: int = 5000,
    dry_run: bool = False,
    step: Callable[[str], None] = lambda _: None,
    progress: Callable[[Mapping[str, Any], int], None] | None = None,
) -> JobResult:
    """Clean a recipient list, inject what is left through the API, and write the outcomes.

    Invalid, duplicate, suppressed and (with ``dns``) undeliverable rows are
    set aside first; ``dry_run`` stops before injecting.  Writes
    outcomes.parquet and sendout.html under ``output``.
    """
    started = time.monotonic()
    now = datetime.now(UTC)
    content, needed = load_template(spark, template)
    paths = expand_inputs(inputs)
    step("sendout: cleaning the list")
    work = recipients(read_list(spark, paths, fmt), address_column)
    work = work.transform(valid_addresses).transform(dedupe)
    if suppression:
        work = work.transform(drop_suppressed, read_suppression(spark, suppression, now))
    if dns is not None:
        step("sendout: checking domains")
        found = verdicts(spark, work.where(F.col("status").isNull()), dns=dns,
                         cache=domain_cache, now=now)
        work = work.transform(check_domains, found)
    work = work.transform(personalise, needed).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        by_status = {r["status"]: r["n"] for r in
                     work.groupBy("status").agg(F.count(F.lit(1)).alias("n")).collect()}
        read = sum(by_status.values())
        to_send = by_status.get(None, 0)
        step(f"sendout: injecting {to_send} of {read} rows")
        ready = work.where(F.col("status").isNull())
        early = work.where(F.col("status").isNotNull()).select(
            "row", "input", "address", "domain", "status",
            F.lit(None).cast("string").alias("queue_id"), F.lit(None).cast("int").alias("code"),
            F.lit(None).cast("string").alias("enhanced"), "reason",
            F.lit(False).alias("duplicate"), F.lit(0).alias("attempts"),
            F.lit(now).cast("timestamp").alias("at"))
        counters = _counters(spark)
        if dry_run:
            sent = ready.select(
                "row", "input", "address", "domain", F.lit("ready").alias("status"),
                F.lit(None).cast("string").alias("queue_id"),
                F.lit(None).cast("int").alias("code"),
                F.lit(None).cast("string").alias("enhanced"),
                F.lit(None).cast("string").alias("reason"), F.lit(False).alias("duplicate"),
                F.lit(0).alias("attempts"), F.lit(now).cast("timestamp").alias("at"))
        else:
            target = InjectTarget(url=api_url, token=token, sender=sender, job=job,
                                  tenant=tenant, template=content, priority=priority,
                                  batch_size=batch_size, concurrency=concurrency)
            sent = (ready.transform(partition_by_domain, rows_per_task, to_send)
                    .mapInPandas(inject_partition(target, counters), OUTCOME_SCHEMA))
        outcomes_path = join(output, "outcomes.parquet")
        if progress is not None:
            progress(counters, to_send)
        injecting = time.monotonic()
        early.unionByName(sent).write.mode("overwrite").parquet(outcomes_path)
        inject_s = time.monotonic() - injecting
    finally:
        work.unpersist()
    step("sendout: summary")
    outcomes = spark.read.parquet(outcomes_path)
    counts = {r["status"]: r["n"] for r in
              outcomes.groupBy("status").agg(F.count(F.lit(1)).alias("n")).collect()}
    duplicates = outcomes.where(F.col("duplicate")).count()
    domains = [r.asDict() for r in outcomes.groupBy("domain").pivot("status", list(STATUSES))
               .agg(F.count(F.lit(1))).na.fill(0)
               .withColumn("rows", sum((F.col(s) for s in STATUSES), F.lit(0)))
               .orderBy(F.col("rows").desc()).limit(15).collect()]
    reasons = [r.asDict() for r in outcomes.where(F.col("status").isin("refused", "invalid"))
               .groupBy("status", "reason").agg(F.count(F.lit(1)).alias("n"))
               .orderBy(F.col("n").desc()).limit(10).collect()]
    elapsed = time.monotonic() - started
    summary: dict[str, Any] = {"rows_read": read, "to_send": to_send}
    summary.update({s: counts.get(s, 0) for s in STATUSES if counts.get(s)})
    summary["answered_from_idempotency_index"] = duplicates
    summary["inject_s"] = round(inject_s, 1)
    summary["rows_per_s"] = round(read / elapsed, 1) if elapsed else 0.0
    html = render_sendout(job=job, tenant=tenant, inputs=paths, summary=summary,
                          statuses=STATUSES, domains=domains, reasons=reasons,
                          generated_at=datetime.now(UTC).isoformat(timespec="seconds"),
                          dry_run=dry_run)
    page = hfs.write_text(spark, join(output, "sendout.html"), html)
    return JobResult("sendout", {"outcomes": outcomes_path, "html": page}, summary, elapsed)
