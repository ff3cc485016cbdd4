"""The end of `sluice demo`: the Spark report over the demo's own accounting log.

SUMMARY
    spark_report(log_dir, out_dir, console) -> bool     False when Spark is not at hand

DESCRIPTION
    After the queue has stopped (its accounting log is complete), the
    analytics' report and bounces jobs run on a local Spark session over
    the log, the tables and report.html go to ``out_dir``, and the
    terminal shows the per-domain outcomes (the largest domains) and the
    bounce classes read back from the tables Spark wrote -- the same
    figures the HTML page draws.

    Without the analytics extra or a Java runtime the demo says so in one
    line and ends as before; the queue part needs neither.

SEE ALSO
    sluice.runtime.demo, sluice.pipeline.jobs, docs/analytics.md
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rich.console import Console
from rich.table import Table

__all__ = ["spark_report"]

#: Domains shown in the terminal (the page has all of them in its tables).
SHOWN_DOMAINS = 10


def _missing() -> str | None:
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return "the analytics extra (PySpark) is not installed"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "no Java runtime on PATH"
    return None


def spark_report(log_dir: Path, out_dir: Path, console: Console) -> bool:
    """Run the Spark jobs over ``log_dir`` into ``out_dir`` and print their tables.

    Returns False, having said why, when Spark or Java is missing.
    """
    missing = _missing()
    if missing is not None:
        console.print(f"No Spark report: {missing}.")
        return False
    from pyspark.sql import functions as F

    from sluice.pipeline.jobs import run_jobs
    from sluice.pipeline.session import pipeline_session

    console.print()
    console.print("[bold]Spark report[/] over the demo's accounting log ...")
    with pipeline_session("local[*]", app_name="sluice-demo", driver_memory="1g") as spark:
        results = run_jobs(spark, [str(log_dir / "*.jsonl")], str(out_dir),
                           ["report", "bounces"])
        attempts = F.col("delivered") + F.col("deferred") + F.col("bounced") + F.col("expired")
        domains = (spark.read.parquet(str(out_dir / "outcomes_by_domain.parquet"))
                   .orderBy(attempts.desc(), "domain").limit(SHOWN_DOMAINS).collect())
        classes = (spark.read.parquet(str(out_dir / "bounce_summary.parquet"))
                   .groupBy("event", "category", "hard")
                   .agg(F.sum("count").alias("count"))
                   .orderBy(F.col("count").desc(), "event", "category").collect())
    seconds = sum(r.elapsed_s for r in results)
    table = Table(title=f"per domain (the {SHOWN_DOMAINS} largest)", title_justify="left")
    for name in ("domain", "received", "delivered", "deferred", "bounced", "delivery rate"):
        table.add_column(name, justify="left" if name == "domain" else "right")
    for r in domains:
        rate = "" if r.delivery_rate is None else f"{r.delivery_rate:.0%}"
        table.add_row(r.domain, str(r.received), str(r.delivered), str(r.deferred),
                      str(r.bounced), rate)
    console.print(table)
    bounces = Table(title="failures by bounce class", title_justify="left")
    for name in ("event", "class", "hard", "count"):
        bounces.add_column(name, justify="right" if name == "count" else "left")
    for r in classes:
        bounces.add_row(r.event, r.category, "yes" if r.hard else "no", str(r["count"]))
    console.print(bounces)
    console.print(f"Spark report in {seconds:.1f} s: {out_dir / 'report.html'}")
    return True
