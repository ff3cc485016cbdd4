"""`sluice analytics ...`: the Spark jobs over the accounting log.

SUMMARY
    sluice analytics report   --input PATH... --output DIR [--top N] [--no-html]
    sluice analytics bounces  --input PATH... --output DIR
    sluice analytics suppress --input PATH... --output DIR [--list FILE]
                              [--soft-count N] [--soft-days D] [--soft-ttl-days T]
    sluice analytics shape    --input PATH... --output DIR [--policy FILE]
    sluice analytics maillog  --input MAILLOG... --output DIR [--year Y] [--timezone TZ]
    sluice analytics all      --input PATH... --output DIR [--jobs report,bounces,...]
    common: [--master URL] [--since WHEN] [--until WHEN] [--driver-memory 2g]
            [--no-progress] [--conf KEY=VALUE]... [--packages COORDS] [--jars JARS]
            [--deploy-mode client|cluster]

DESCRIPTION
    Inputs are files or globs of JSON-lines accounting logs or Parquet
    (``events.parquet`` from ``maillog``, for one); quote globs so the
    shell leaves them to us.  WHEN is a date or time in UTC
    (2026-11-22, 2026-11-22T10:00Z) or a duration ago (24h, 7d).  The
    master defaults to ``analytics.master`` (``local[*]``: Spark embedded
    in this process).

    PySpark is an optional part of Sluice: without it these commands say
    how to install it and exit 1, and the rest of `sluice` works as ever.
    This module therefore imports nothing of Spark until a job runs.

    ``all`` runs several of report, bounces, suppress and shape over one
    read of the input (the daily run): the options of each apply.

    Errors: bad input and errors raised in the JVM (an unreachable HDFS,
    a file system class that is not on the classpath) end the command with
    one line and exit status 2, never a Py4J traceback.

SEE ALSO
    sluice.pipeline.jobs, docs/analytics.md
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from sluice.cli import CommandError, load

__all__ = ["add_spark_options", "print_results", "register", "run_in_spark", "spark_conf",
           "spark_error_line", "submit_argv"]

INSTALL_HINT = "pip install 'sluice-mta[analytics]'"


def register(subparsers: Any) -> None:
    """Add `sluice analytics` and its jobs to the command line."""
    parser = subparsers.add_parser(
        "analytics",
        help="reports, bounce classes, suppression list, shaping advice (Spark)",
        description="Spark jobs over the accounting log (needs the analytics extra and Java).",
    )
    jobs = parser.add_subparsers(dest="job", metavar="JOB")
    jobs.required = True

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--input", "-i", nargs="+", required=True, metavar="PATH",
                        help="accounting files, globs or Parquet directories")
    common.add_argument("--output", "-o", required=True, metavar="DIR",
                        help="directory for the tables and files (replaced)")
    common.add_argument("--master", metavar="URL",
                        help="Spark master (default: analytics.master, local[*])")
    common.add_argument("--since", metavar="WHEN", help="only events at or after WHEN")
    common.add_argument("--until", metavar="WHEN", help="only events before WHEN")
    common.add_argument("--driver-memory", metavar="SIZE", default=None,
                        help="Spark driver memory for a new local session (default 2g)")
    common.add_argument("--no-progress", action="store_true",
                        help="no progress bar (default when stderr is not a terminal)")
    add_spark_options(common)

    p = jobs.add_parser("report", parents=[common],
                        help="outcomes per domain/tenant/job/IP/MX and hour, HTML report")
    p.add_argument("--top", type=int, default=10, metavar="N", help="reasons kept per kind")
    p.add_argument("--no-html", action="store_true", help="tables only")
    p.set_defaults(func=_report)

    p = jobs.add_parser("bounces", parents=[common],
                        help="classify deferrals and bounces (PowerMTA categories, hard/soft)")
    p.set_defaults(func=_bounces)

    p = jobs.add_parser("suppress", parents=[common],
                        help="write the suppression list the queue reads")
    p.add_argument("--list", dest="list_path", metavar="FILE",
                   help="the list to merge into (default: suppression.path, "
                        "else DIR/suppression.jsonl)")
    p.add_argument("--soft-count", type=int, metavar="N",
                   help="soft failures in a row (default: analytics.suppress_soft_count)")
    p.add_argument("--soft-days", type=float, metavar="D",
                   help="within so many days (default: analytics.suppress_soft_days)")
    p.add_argument("--soft-ttl-days", type=float, metavar="T",
                   help="soft entries expire after T days, 0 never "
                        "(default: analytics.suppress_soft_ttl_days)")
    p.set_defaults(func=_suppress)

    p = jobs.add_parser("shape", parents=[common],
                        help="throttling per destination -> pickup policy YAML")
    p.add_argument("--policy", dest="policy_path", metavar="FILE",
                   help="where to write the policy (default DIR/policy.yaml)")
    p.set_defaults(func=_shape)

    p = jobs.add_parser("all", parents=[common],
                        help="several jobs over one read of the input (the daily run)")
    p.add_argument("--jobs", default="report,bounces,suppress,shape",
                   help="comma-separated (default: report,bounces,suppress,shape)")
    p.add_argument("--top", type=int, default=10, metavar="N", help="reasons kept per kind")
    p.add_argument("--no-html", action="store_true", help="tables only")
    p.add_argument("--list", dest="list_path", metavar="FILE")
    p.add_argument("--soft-count", type=int, metavar="N")
    p.add_argument("--soft-days", type=float, metavar="D")
    p.add_argument("--soft-ttl-days", type=float, metavar="T")
    p.add_argument("--policy", dest="policy_path", metavar="FILE")
    p.set_defaults(func=_all)

    p = jobs.add_parser("ingest", parents=[common],
                        help="append new accounting lines to a Parquet table by day "
                             "(-o TABLE; idempotent); reports then read -i TABLE")
    p.set_defaults(func=_ingest)

    p = jobs.add_parser("maillog", parents=[common],
                        help="a Postfix maillog as accounting events (DIR/events.parquet)")
    p.add_argument("--year", type=int, help="year of traditional syslog stamps (default: now)")
    p.add_argument("--timezone", default="UTC", metavar="TZ",
                   help="zone of traditional syslog stamps (default UTC)")
    p.set_defaults(func=_maillog)


# --------------------------------------------------------------------------

def add_spark_options(parser: argparse.ArgumentParser) -> None:
    """--conf, --packages, --jars, --deploy-mode: Spark settings passed through."""
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                        help="a Spark setting, e.g. spark.executor.memory=4g (repeatable)")
    parser.add_argument("--packages", metavar="COORDS",
                        help="Maven coordinates for the driver and executors, comma-separated "
                             "(e.g. org.apache.hadoop:hadoop-aws:3.5.0 for s3a://)")
    parser.add_argument("--jars", metavar="JARS", help="jar files, comma-separated")
    parser.add_argument("--deploy-mode", choices=("client", "cluster"), default="client",
                        help="client: the driver runs here (default); cluster: submit this "
                             "command with spark-submit to run its driver on the cluster "
                             "(YARN, Kubernetes)")


def spark_conf(args: argparse.Namespace) -> dict[str, str]:
    """The session settings the options name; CommandError (2) on a bad --conf."""
    conf: dict[str, str] = {}
    for item in args.conf:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CommandError(f"--conf {item!r}: use KEY=VALUE", status=2)
        conf[key.strip()] = value.strip()
    if args.packages:
        conf["spark.jars.packages"] = args.packages
    if args.jars:
        conf["spark.jars"] = args.jars
    return conf


def _without_deploy_mode(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for item in argv:
        if skip:
            skip = False
            continue
        if item == "--deploy-mode":
            skip = True
            continue
        if item.startswith("--deploy-mode="):
            continue
        out.append(item)
    return out


def submit_argv(args: argparse.Namespace, argv: Sequence[str], master: str) -> list[str]:
    """The spark-submit command that runs this command's driver on the cluster."""
    import pyspark

    from sluice.cli import spark_main

    home = Path(pyspark.__file__).parent
    cmd = [str(home / "bin" / "spark-submit"), "--master", master, "--deploy-mode", "cluster"]
    for key, value in spark_conf(args).items():
        if key not in ("spark.jars.packages", "spark.jars"):
            cmd += ["--conf", f"{key}={value}"]
    if args.packages:
        cmd += ["--packages", args.packages]
    if args.jars:
        cmd += ["--jars", args.jars]
    return [*cmd, spark_main.__file__, *_without_deploy_mode(argv)]


def spark_error_line(exc: BaseException) -> str:
    """One line for an error Spark raised, without the stack traces.

    The JVM's exception, or the Python error of a task.
    """
    text = str(exc).strip()
    java = getattr(exc, "java_exception", None)
    if java is not None:  # a Py4JJavaError: the Java exception's own line
        with contextlib.suppress(Exception):
            text = str(java.toString())
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    stop = next((i for i, line in enumerate(lines) if line.startswith("JVM stacktrace")),
                len(lines))
    raised = [line for line in lines[:stop]
              if re.match(r"^[\w.]+(Error|Exception): ", line)]
    line = (raised[-1] if raised else lines[0])[:500]
    if "S3AFileSystem" in line or 'No FileSystem for scheme "s3' in line:
        line += f" (s3a:// needs --packages org.apache.hadoop:hadoop-aws:{_hadoop_version()})"
    return line


def _hadoop_version() -> str:
    """The Hadoop version PySpark ships, which hadoop-aws must match."""
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    for jar in jars.glob("hadoop-client-api-*.jar"):
        return jar.stem.removeprefix("hadoop-client-api-")
    return "<the Hadoop version of your Spark>"


def _require_spark() -> None:
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise CommandError(
            f"the analytics commands need PySpark, which is not installed: {INSTALL_HINT}"
        ) from None
    if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
        raise CommandError("the analytics commands need Java 17 or later (java not found)")


def _when(text: str | None, option: str) -> datetime | None:
    if text is None:
        return None
    from sluice.pipeline.events import parse_when

    try:
        return parse_when(text)
    except ValueError as exc:
        raise CommandError(f"{option}: {exc}", status=2) from None


def run_in_spark(args: argparse.Namespace, app_name: str,
                 work: Callable[[Any, Any], Any], precheck: Callable[[], None] | None = None
                 ) -> Any:
    """Run ``work(spark, step)`` in a session with the options' settings, under a progress bar.

    The session is started or reused.  Every expected failure becomes one
    line: input errors, bad values and errors in the JVM exit 2.
    """
    _require_spark()
    cfg = load(args)
    master = args.master or cfg.analytics.master
    conf = spark_conf(args)
    if args.deploy_mode == "cluster":
        import subprocess

        if master.startswith("local"):
            raise CommandError("--deploy-mode cluster needs a cluster --master "
                               "(yarn, k8s://..., spark://...)", status=2)
        return subprocess.call(submit_argv(args, sys.argv[1:], master))
    with warnings.catch_warnings():
        # PySpark warns about pandas versions on import; we use no pandas.
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyspark\..*")
        from py4j.protocol import Py4JError
        from pyspark.errors import PySparkException

        from sluice.pipeline.extract import InputError
        from sluice.pipeline.progress import SparkProgress
        from sluice.pipeline.session import pipeline_session
        from sluice.suppression import SuppressionFileError

        if precheck is not None:
            try:  # before the JVM starts: a typo should cost no seconds
                precheck()
            except InputError as exc:
                raise CommandError(str(exc), status=2) from None
        show = not args.no_progress and sys.stderr.isatty()
        try:
            with pipeline_session(master, app_name=app_name, conf=conf,
                                  driver_memory=args.driver_memory) as spark, \
                    SparkProgress(spark, enabled=show) as progress:
                return work(spark, progress.step)
        except InputError as exc:
            raise CommandError(str(exc), status=2) from None
        except (PySparkException, Py4JError) as exc:
            raise CommandError(f"Spark: {spark_error_line(exc)}", status=2) from None
        except SuppressionFileError as exc:
            raise CommandError(f"suppression list: {exc}") from None
        except ValueError as exc:
            raise CommandError(str(exc), status=2) from None
        except OSError as exc:
            raise CommandError(f"{exc.filename or args.output}: {exc.strerror or exc}") from None


def print_results(result: Any) -> None:
    """Print what each job did: its time, its counts and the files it wrote."""
    for one in result if isinstance(result, list) else [result]:
        print(f"sluice {'' if one.job == 'sendout' else 'analytics '}{one.job}: "
              f"done in {one.elapsed_s:.1f} s")
        for key, value in one.counts.items():
            shown = f"{value:.4f}" if isinstance(value, float) else value
            print(f"  {key}: {shown}")
        for key, path in one.outputs.items():
            print(f"  {key} -> {path}")


def _run(args: argparse.Namespace, job_name: str, module: str = "sluice.pipeline.jobs",
         **kwargs: Any) -> int:
    since = _when(args.since, "--since")
    until = _when(args.until, "--until")
    if since and until and since >= until:
        raise CommandError("--since must be before --until", status=2)

    def precheck() -> None:
        from sluice.pipeline.extract import expand_inputs

        expand_inputs(args.input)

    def work(spark: Any, step: Callable[[str], None]) -> Any:
        import importlib

        jobs = importlib.import_module(module)
        job: Callable[..., Any] = getattr(jobs, job_name)
        return job(spark, args.input, args.output, since=since, until=until, step=step,
                   **kwargs)

    result = run_in_spark(args, "sluice-analytics", work, precheck)
    if isinstance(result, int):  # submitted with --deploy-mode cluster
        return result
    print_results(result)
    return 0


def _report(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise CommandError("--top must be at least 1", status=2)
    return _run(args, "run_report", top=args.top, html=not args.no_html)


def _bounces(args: argparse.Namespace) -> int:
    return _run(args, "run_bounces")


def _suppress_options(args: argparse.Namespace) -> dict[str, Any]:
    cfg = load(args)
    a = cfg.analytics
    soft_count = args.soft_count if args.soft_count is not None else a.suppress_soft_count
    soft_days = args.soft_days if args.soft_days is not None else a.suppress_soft_days
    ttl = args.soft_ttl_days if args.soft_ttl_days is not None else a.suppress_soft_ttl_days
    if soft_count < 1 or soft_days <= 0 or ttl < 0:
        raise CommandError("--soft-count >= 1, --soft-days > 0 and --soft-ttl-days >= 0",
                           status=2)
    return {"list_path": args.list_path or cfg.suppression.path, "soft_count": soft_count,
            "soft_days": soft_days, "soft_ttl_days": ttl}


def _suppress(args: argparse.Namespace) -> int:
    return _run(args, "run_suppress", **_suppress_options(args))


def _all(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.jobs.split(",") if n.strip()]
    allowed = ("report", "bounces", "suppress", "shape")
    if not names or any(n not in allowed for n in names):
        raise CommandError(f"--jobs: choose from {', '.join(allowed)}", status=2)
    if args.top < 1:
        raise CommandError("--top must be at least 1", status=2)
    options = {
        "report": {"top": args.top, "html": not args.no_html},
        "suppress": _suppress_options(args),
        "shape": {"policy_path": args.policy_path},
    }
    return _run(args, "run_jobs", names=names, options=options)


def _shape(args: argparse.Namespace) -> int:
    return _run(args, "run_shape", policy_path=args.policy_path)


def _ingest(args: argparse.Namespace) -> int:
    return _run(args, "run_ingest", module="sluice.pipeline.ingest")


def _maillog(args: argparse.Namespace) -> int:
    return _run(args, "run_maillog", year=args.year, tz=args.timezone)
