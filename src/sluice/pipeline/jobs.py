"""Jobs: extract -> transform -> load, one function per `sluice analytics` command.

SUMMARY
    run_jobs(spark, inputs, output, ["report", "bounces", ...], options=...)
        -> list[JobResult]          several jobs over one read of the inputs
    run_report(spark, inputs, output, since=None, until=None, top=10) -> JobResult
    run_bounces(spark, inputs, output, since=None, until=None) -> JobResult
    run_suppress(spark, inputs, output, list_path=None, soft_count=5,
                 soft_days=7.0, soft_ttl_days=30.0, ...) -> JobResult
    run_shape(spark, inputs, output, policy_path=None, ...) -> JobResult
    run_maillog(spark, inputs, output, year=None, tz="UTC", ...) -> JobResult

DESCRIPTION
    Each job reads its inputs (sluice.pipeline.extract), chains pure
    transformations with DataFrame.transform, and writes its tables
    (sluice.pipeline.load).  The returned JobResult names every output and
    carries the headline counts, which the CLI prints.

    Outputs under OUTPUT:
      report    outcomes_hourly, outcomes_by_hour, outcomes_by_domain,
                outcomes_total, reasons_top, reasons_by_domain,
                clients (received mail and connections by SMTP client)
                (.parquet/ and .csv/), report.html
      bounces   bounces (every classified failure, Parquet),
                bounce_summary (.parquet/ and .csv/)
      suppress  suppression (.parquet/ and .csv/), and the list itself at
                list_path (default OUTPUT/suppression.jsonl), merged with
                the list already there
      shape     throttle_findings (.parquet/ and .csv/), shaping-advice.yaml
                (sluice.pipeline.advice), policy.yaml (or policy_path)
      maillog   events.parquet/ (EVENT_SCHEMA: feed it to the others)

STRATEGIES
    Read once.  Parsing JSON is most of the cost, so run_jobs reads the
    inputs once for all the jobs it runs and persists the events (memory,
    then disk); small aggregates are persisted too, because each table is
    written twice.  The job functions (report_job, bounces_job, ...) take a
    Source of events already read; run_report() and friends are one-job
    run_jobs() calls.

    Cache only what is read.  Building Spark's columnar cache costs about
    as much as parsing the JSON, per column.  Every job reads whole only
    some kinds of events (WHOLE_EVENTS: the failures for report and
    bounces); the report also reads OUTCOME_COLUMNS of every event.  So
    the cache holds every column of those kinds, the outcome columns of
    the rest (other columns null), and no row that no job reads; and the
    failures' masked reply (bounces.with_masked_reply), so that masking,
    the costly step after parsing, runs once per failure.  The classified
    failures are not cached again: classify_masked() is a broadcast join
    on the cached rows.

    Parquet is read again, not cached.  When every input is Parquet (an
    ingested table), reading a column again is cheaper than building
    Spark's cache of it: the report reads its outcome columns from the
    table, and only the failures, masked (masked_failures), are cached for
    the classification, the reasons and the bounces.  On 1M events from a
    table the cache step cost 7.2 CPU-seconds caching what every job reads,
    4.6 caching the failures alone, and the report's aggregation no more.
    A table ingest wrote holds the failures' masks already
    (bounces.with_masked_reply takes them), so over it no reply is masked.

SEE ALSO
    sluice.cli.analytics_cmds, docs/analytics.md
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from sluice.accounting import iso_time
from sluice.pipeline import hfs, load
from sluice.pipeline.advice import advice_rules, advice_yaml
from sluice.pipeline.bounces import (
    MASKED_COLUMN,
    bounce_summary,
    classify_failures,
    classify_masked,
    with_masked_reply,
)
from sluice.pipeline.clients import CLIENT_COLUMNS, CLIENT_EVENTS, clients
from sluice.pipeline.events import between
from sluice.pipeline.extract import expand_inputs, is_parquet, read_events, read_lines
from sluice.pipeline.html import ReportData, render_report
from sluice.pipeline.maillog import maillog_events, parse_lines
from sluice.pipeline.policy import build_policy, limits_from_findings, policy_yaml
from sluice.pipeline.report import (
    OUTCOME_COLUMNS,
    Level,
    largest_domains,
    level,
    outcomes,
    reasons,
    top_reasons,
)
from sluice.pipeline.rules import FAILURE_EVENTS
from sluice.pipeline.schema import STORED_SCHEMA
from sluice.pipeline.shape import per_destination, throttle_findings
from sluice.pipeline.suppress import last_delivered, suppressions
from sluice.pipeline.suppress_list import merge_lists, read_list, write_list

#: Domains the HTML report draws (the charts keep the 15 largest by attempts
#: and by deliveries; both sets are fetched).
CHART_DOMAINS = 15

__all__ = [
    "JOBS",
    "WHOLE_EVENTS",
    "JobResult",
    "Source",
    "bounces_job",
    "cached_events",
    "masked_failures",
    "open_source",
    "report_job",
    "run_bounces",
    "run_jobs",
    "run_maillog",
    "run_report",
    "run_shape",
    "run_suppress",
    "shape_job",
    "suppress_job",
]

Step = Callable[[str], None]


def _no_step(_: str) -> None:
    return None


@dataclass(frozen=True, slots=True)
class JobResult:
    """What one job wrote (name -> path), its counts, and how long it took."""
    job: str
    outputs: dict[str, str] = field(default_factory=dict)
    counts: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Source:
    """Events read once for one or more jobs."""

    paths: list[str]
    events: DataFrame
    until: datetime | None = None
    #: the failures classified (CLASSIFIED_SCHEMA), when a job needs them
    classified: DataFrame | None = None


def open_source(
    spark: SparkSession,
    inputs: Sequence[str],
    since: datetime | None = None,
    until: datetime | None = None,
) -> Source:
    """The events of ``inputs`` between ``since`` and ``until``, read once for the jobs.

    When every input is Parquet, the events keep the columns an ingested
    table stores (STORED_SCHEMA; null where a table has none).
    """
    paths = expand_inputs(inputs)
    extra = STORED_SCHEMA if all(is_parquet(p) for p in paths) else None
    events = read_events(spark, paths, extra).transform(between, since=since, until=until)
    return Source(paths, events, until)


def _tables(out: dict[str, str], prefix: str, written: dict[str, str]) -> None:
    for kind, path in written.items():
        out[f"{prefix}.{kind}"] = path


def report_job(
    source: Source,
    output: str,
    *,
    top: int = 10,
    html: bool = True,
    step: Step = _no_step,
) -> JobResult:
    """The report from events already read (see run_jobs)."""
    started = time.monotonic()
    events = source.events
    step("report: outcomes")
    outcome_rows = outcomes(events).persist(StorageLevel.MEMORY_AND_DISK)
    failures = source.classified if source.classified is not None else events
    reason_rows = reasons(failures).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        written: dict[str, str] = {}
        tables = {
            "outcomes_hourly": level(outcome_rows, Level.HOURLY),
            "outcomes_by_hour": level(outcome_rows, Level.HOUR),
            "outcomes_by_domain": level(outcome_rows, Level.DOMAIN),
            "outcomes_total": level(outcome_rows, Level.TOTAL),
        }
        layout: dict[str, dict[str, Any]] = {"outcomes_hourly": {"by_day": "hour"},
                  "outcomes_by_hour": {"by_day": "hour", "single": True},
                  "outcomes_by_domain": {},
                  "outcomes_total": {"single": True}}
        for name, df in tables.items():
            step(f"report: {name}")
            _tables(written, name, load.write_table(df, output, name, **layout[name]))
        step("report: reasons")
        top_all = top_reasons(reason_rows, top)
        by_domain = top_reasons(reason_rows, top, by_domain=True)
        _tables(written, "reasons_top",
                load.write_table(top_all, output, "reasons_top", single=True))
        _tables(written, "reasons_by_domain",
                load.write_table(by_domain, output, "reasons_by_domain"))
        step("report: clients")
        _tables(written, "clients", load.write_table(clients(events), output, "clients"))
        totals_rows = load.rows(tables["outcomes_total"])
        totals = totals_rows[0] if totals_rows else {}
        if html:
            step("report: HTML")
            by_hour = load.rows(tables["outcomes_by_hour"])
            period = (by_hour[0]["hour"], by_hour[-1]["hour"]) if by_hour else None
            data = ReportData(
                generated_at=iso_time(time.time()),
                totals=totals,
                by_hour=by_hour,
                by_domain=load.rows(largest_domains(tables["outcomes_by_domain"],
                                                    CHART_DOMAINS)),
                reasons=load.rows(top_all),
                inputs=source.paths,
                period=period,
            )
            written["html"] = load.write_file(events.sparkSession, output, "report.html",
                                              render_report(data))
    finally:
        outcome_rows.unpersist()
        reason_rows.unpersist()
    counts = {k: totals.get(k) for k in ("received", "delivered", "deferred", "bounced",
                                         "expired", "delivery_rate")}
    return JobResult("report", written, counts, time.monotonic() - started)


def bounces_job(source: Source, output: str, *, step: Step = _no_step) -> JobResult:
    """Bounce classification from events already read (see run_jobs)."""
    started = time.monotonic()
    step("bounces: classifying")
    shared = source.classified is not None
    classified = source.classified if source.classified is not None else (
        source.events.transform(classify_failures).persist(StorageLevel.MEMORY_AND_DISK)
    )
    try:
        written: dict[str, str] = {}
        _tables(written, "bounces", load.write_table(classified, output, "bounces", csv=False,
                                                     by_day="time"))
        step("bounces: summary")
        summary = classified.transform(bounce_summary).persist(StorageLevel.MEMORY_AND_DISK)
        _tables(written, "bounce_summary", load.write_table(summary, output, "bounce_summary"))
        by_category = load.rows(
            summary.groupBy("category", "hard").agg(F.sum("count").alias("count"))
            .orderBy(F.col("count").desc())
        )
        summary.unpersist()
    finally:
        if not shared:
            classified.unpersist()
    counts: dict[str, Any] = {
        f"{r['category']}{' (hard)' if r['hard'] else ''}": r["count"] for r in by_category
    }
    return JobResult("bounces", written, counts, time.monotonic() - started)


def suppress_job(
    source: Source,
    output: str,
    *,
    list_path: str | None = None,
    soft_count: int = 5,
    soft_days: float = 7.0,
    soft_ttl_days: float = 30.0,
    now: float | None = None,
    step: Step = _no_step,
) -> JobResult:
    """Find suppressions, write them as tables and merge them into the list.

    The list is read, merged and written by Spark (sluice.pipeline.
    suppress_list): however long it is, no entry passes through the driver.
    """
    started = time.monotonic()
    step("suppress: finding recipients")
    spark = source.events.sparkSession
    events = source.events
    target = list_path or load.join(output, "suppression.jsonl")
    found = events.transform(
        suppressions,
        soft_count=soft_count,
        soft_days=soft_days,
        soft_ttl_days=soft_ttl_days,
        until=source.until,
        classified=source.classified,
    ).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        written: dict[str, str] = {}
        _tables(written, "suppression", load.write_table(found, output, "suppression"))
        step("suppress: merging the list")
        found_by = {r["reason"]: r["n"] for r in load.rows(
            found.groupBy("reason").agg(F.count(F.lit(1)).alias("n")))}
        at = datetime.fromtimestamp(time.time() if now is None else now, UTC)
        old = read_list(spark, target)
        before = old.count() if old is not None else 0
        merged = merge_lists(old, found, last_delivered(events), at)
        after = write_list(spark, merged, target, at)
    finally:
        found.unpersist()
    written["list"] = target
    counts = {
        "found_hard": found_by.get("hard", 0),
        "found_soft": found_by.get("soft", 0),
        "listed_before": before,
        "listed_now": after,
    }
    return JobResult("suppress", written, counts, time.monotonic() - started)


def shape_job(
    source: Source,
    output: str,
    *,
    policy_path: str | None = None,
    step: Step = _no_step,
) -> JobResult:
    """Throttle findings and the advised policy from events already read."""
    started = time.monotonic()
    step("shape: throttling replies")
    paths, events = source.paths, source.events
    findings = events.transform(throttle_findings).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        written: dict[str, str] = {}
        _tables(written, "throttle_findings",
                load.write_table(findings, output, "throttle_findings", single=True))
        rows = load.rows(per_destination(findings))
    finally:
        findings.unpersist()
    limits = limits_from_findings(rows)
    comment = (
        f"Pickup policy advised by `sluice analytics shape` at {iso_time(time.time())}\n"
        f"from {len(paths)} input file(s); {len(limits)} destination(s) throttled us.\n"
        "Per source IP and destination: rate = 90 % of what was accepted while throttled,\n"
        "concurrency = one below the in-flight count at throttling. Review before use."
    )
    text = policy_yaml(build_policy(limits), comment)
    spark = events.sparkSession
    if policy_path:
        written["policy"] = hfs.write_text(spark, policy_path, text)
    else:
        written["policy"] = load.write_file(spark, output, "policy.yaml", text)
    made_at = iso_time(time.time())
    advice = advice_rules(limits, made_at)
    written["shaping"] = load.write_file(spark, output, "shaping-advice.yaml", advice_yaml(
        advice,
        f"Shaping rules advised by `sluice analytics shape` at {made_at}: when a destination\n"
        "throttles again, go at once to what it took last time. Use as delivery.shaping,\n"
        "or install now with `sluice shaping apply FILE` (try --dry-run first)."))
    counts = {"destinations": len(limits), "throttled_attempts": sum(r["throttled"] for r in rows),
              "advice_rules": len(advice["rules"])}
    return JobResult("shape", written, counts, time.monotonic() - started)


def run_maillog(
    spark: SparkSession,
    inputs: Sequence[str],
    output: str,
    *,
    year: int | None = None,
    tz: str = "UTC",
    since: datetime | None = None,
    until: datetime | None = None,
    step: Step = _no_step,
) -> JobResult:
    """Parse Postfix mail log lines into an events table under ``output``.

    ``year`` and ``tz`` complete the syslog timestamps, which have neither;
    returns the counts by event.
    """
    started = time.monotonic()
    step("maillog: parsing")
    lines = read_lines(spark, expand_inputs(inputs))
    events = (
        lines.transform(parse_lines, year=year, tz=tz)
        .transform(maillog_events)
        .transform(between, since=since, until=until)
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    try:
        written: dict[str, str] = {}
        _tables(written, "events", load.write_table(events, output, "events", csv=False,
                                                    by_day="time"))
        by_kind = load.rows(events.groupBy("event").count())
    finally:
        events.unpersist()
    counts = {r["event"]: r["count"] for r in sorted(by_kind, key=lambda r: r["event"])}
    return JobResult("maillog", written, counts, time.monotonic() - started)


#: The jobs that run on accounting events, in the order run_jobs runs them.
JOBS: dict[str, Callable[..., JobResult]] = {
    "report": report_job,
    "bounces": bounces_job,
    "suppress": suppress_job,
    "shape": shape_job,
}

#: The kinds of events each job reads with all their columns; of other
#: kinds the report reads OUTCOME_COLUMNS and no job anything else.
WHOLE_EVENTS: dict[str, tuple[str, ...]] = {
    "report": FAILURE_EVENTS,  # reasons
    "bounces": FAILURE_EVENTS,
    "suppress": ("delivered", "bounced", "expired"),
    "shape": ("delivered", "deferred", "bounced"),
}

#: Jobs that read the classified failures.
_CLASSIFYING = frozenset({"report", "bounces", "suppress"})


def cached_events(events: DataFrame, names: Sequence[str]) -> DataFrame:
    """What run_jobs caches for ``names``: only the rows and columns they read.

    Kinds in WHOLE_EVENTS of a job keep every column; when the report runs,
    other kinds keep OUTCOME_COLUMNS (received and session lines
    CLIENT_COLUMNS too; the rest null), else they are left out.  When a
    job classifies failures, MASKED_COLUMN is added.
    """
    whole = sorted({kind for name in names for kind in WHOLE_EVENTS[name]})
    keep = F.col("event").isin(*whole)
    if "report" in names:
        client = keep | F.col("event").isin(*CLIENT_EVENTS)  # the clients table
        compact = events.select(*[
            F.col(c) if c in OUTCOME_COLUMNS
            else F.when(client if c in CLIENT_COLUMNS else keep, F.col(c)).alias(c)
            for c in events.columns
        ])
    else:
        compact = events.where(keep)
    return with_masked_reply(compact) if _CLASSIFYING & set(names) else compact


def masked_failures(events: DataFrame) -> DataFrame:
    """The failures of ``events`` with MASKED_COLUMN: what run_jobs caches of Parquet."""
    return with_masked_reply(events.where(F.col("event").isin(*FAILURE_EVENTS)))


def run_jobs(
    spark: SparkSession,
    inputs: Sequence[str],
    output: str,
    names: Sequence[str],
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    step: Step = _no_step,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[JobResult]:
    """Several jobs over one read of the inputs; options per job name.

    Parsing JSON is most of the cost, so it is done once however many
    tables come out: the rows and columns the jobs read are persisted
    (memory, then disk; see cached_events), the failures masked on the way.
    """
    unknown = [n for n in names if n not in JOBS]
    if unknown or not names:
        raise ValueError(f"unknown job(s) {', '.join(unknown) or '(none)'}; "
                         f"choose from {', '.join(JOBS)}")
    source = open_source(spark, inputs, since, until)
    columnar = all(is_parquet(p) for p in source.paths)
    if columnar:
        # Parquet: each job reads the columns it needs again, and only the
        # masked failures are cached (see Strategies).
        cache = masked_failures(source.events) if _CLASSIFYING & set(names) else None
        events = source.events
    else:
        cache = cached_events(source.events, names)
        events = cache.drop(MASKED_COLUMN) if MASKED_COLUMN in cache.columns else cache
    if cache is not None:
        cache = cache.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        classified = None
        if cache is not None and MASKED_COLUMN in cache.columns:
            step("reading, classifying failures")
            classified = classify_masked(cache)
        source = Source(source.paths, events, until, classified)
        results = []
        for name in JOBS:
            if name in names:
                opts = dict((options or {}).get(name, {}))
                results.append(JOBS[name](source, output, step=step, **opts))
        return results
    finally:
        if cache is not None:
            cache.unpersist()


def run_report(
    spark: SparkSession,
    inputs: Sequence[str],
    output: str,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    top: int = 10,
    html: bool = True,
    step: Step = _no_step,
) -> JobResult:
    """Run the report job alone (see run_jobs)."""
    return run_jobs(spark, inputs, output, ["report"], since=since, until=until, step=step,
                    options={"report": {"top": top, "html": html}})[0]


def run_bounces(
    spark: SparkSession,
    inputs: Sequence[str],
    output: str,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    step: Step = _no_step,
) -> JobResult:
    """Run the bounces job alone (see run_jobs)."""
    return run_jobs(spark, inputs, output, ["bounces"], since=since, until=until,
                    step=step)[0]


def run_suppress(
    spark: SparkSession,
    inputs: Sequence[str],
    output: str,
    *,
    list_path: str | None = None,
    soft_count: int = 5,
    soft_days: float = 7.0,
    soft_ttl_days: float = 30.0,
    since: datetime | None = None,
    until: datetime | None = None,
    now: float | None = None,
    step: Step = _no_step,
) -> JobResult:
    """Run the suppress job alone (see run_jobs), with its thresholds as options."""
    options = {"list_path": list_path, "soft_count": soft_count, "soft_days": soft_days,
               "soft_ttl_days": soft_ttl_days, "now": now}
    return run_jobs(spark, inputs, output, ["suppress"], since=since, until=until, step=step,
                    options={"suppress": options})[0]


def run_shape(
    spark: SparkSession,
    inputs: Sequence[str],
    output: str,
    *,
    policy_path: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    step: Step = _no_step,
) -> JobResult:
    """Run the shape job alone (see run_jobs)."""
    return run_jobs(spark, inputs, output, ["shape"], since=since, until=until, step=step,
                    options={"shape": {"policy_path": policy_path}})[0]
