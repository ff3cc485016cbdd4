"""`sluice sendout`: a campaign list through Spark into the injection API.

SUMMARY
    sluice sendout --input PATH... --template FILE --job ID --sender ADDRESS
                   --output DIR [--tenant T] [--format csv|json|parquet]
                   [--address-column email] [--suppression LIST]
                   [--check-domains [--dns-server HOST[:PORT]]... [--domain-cache DIR]]
                   [--api URL] [--token TOKEN] [--priority 0|1]
                   [--batch-size 100] [--concurrency 4] [--rows-per-task 5000]
                   [--dry-run] [--master URL] [--conf KEY=VALUE]... [--packages ...]

DESCRIPTION
    Reads the list (any path Spark reads), checks each address, drops
    duplicates and suppressed addresses (the list ``sluice analytics
    suppress`` writes: --suppression, default ``suppression.path``),
    optionally drops domains that take no mail, personalises the template
    with each row's columns, and injects the rest through POST
    /api/v1/inject of a running `sluice serve` (--api, default from
    ``api.listen``; --token, $SLUICE_API_TOKEN or the first of
    ``api.tokens``).  Writes OUTPUT/outcomes.parquet (one row per input
    row) and OUTPUT/sendout.html, and prints the summary.

    Running the same job id again queues nothing twice: each recipient's
    idempotency key is derived from the job id and the address.

SEE ALSO
    sluice.pipeline.sendout_job, docs/analytics.md
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from sluice.cli import CommandError, load
from sluice.cli.analytics_cmds import add_spark_options, print_results, run_in_spark

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add `sluice sendout` to the command line."""
    p = subparsers.add_parser(
        "sendout", help="send a campaign list through Spark and the injection API",
        description="Clean, personalise and inject a recipient list with Spark.")
    p.add_argument("--input", "-i", nargs="+", required=True, metavar="PATH",
                   help="the recipient list: CSV with a header, JSON lines or Parquet")
    p.add_argument("--template", "-t", required=True, metavar="FILE",
                   help="YAML: from, subject, text, html, headers (Jinja2)")
    p.add_argument("--job", required=True, help="the job id (jobid); keys idempotency")
    p.add_argument("--sender", required=True, metavar="ADDRESS", help="the envelope sender")
    p.add_argument("--output", "-o", required=True, metavar="DIR",
                   help="directory for outcomes.parquet and sendout.html")
    p.add_argument("--tenant", default="", help="the tenant id (tenantid)")
    p.add_argument("--format", dest="fmt", choices=("csv", "json", "parquet"),
                   help="the list's format (default: by extension, else CSV)")
    p.add_argument("--address-column", default="email", metavar="NAME",
                   help="the column with the address (default email)")
    p.add_argument("--suppression", metavar="LIST",
                   help="suppression list (JSON lines or suppression.parquet; default "
                        "suppression.path; 'none' for none)")
    p.add_argument("--check-domains", action="store_true",
                   help="drop domains with a null MX, or without MX and address (DNS)")
    p.add_argument("--dns-server", action="append", default=[], metavar="HOST[:PORT]",
                   help="DNS server for --check-domains (default: the system's)")
    p.add_argument("--domain-cache", metavar="DIR",
                   help="Parquet table of domain verdicts kept between runs (a day)")
    p.add_argument("--api", metavar="URL", help="the injection API (default from api.listen)")
    p.add_argument("--token", help="API token (default $SLUICE_API_TOKEN, then api.tokens)")
    p.add_argument("--priority", type=int, choices=(0, 1), default=0)
    p.add_argument("--batch-size", type=int, default=100, metavar="N",
                   help="recipients per request (default 100)")
    p.add_argument("--concurrency", type=int, default=4, metavar="N",
                   help="requests in flight per Spark task (default 4)")
    p.add_argument("--rows-per-task", type=int, default=5000, metavar="N",
                   help="rows per Spark task when injecting (default 5000)")
    p.add_argument("--dry-run", action="store_true",
                   help="clean and personalise, send nothing (outcome: ready)")
    p.add_argument("--master", metavar="URL",
                   help="Spark master (default: analytics.master, local[*])")
    p.add_argument("--driver-memory", metavar="SIZE", default=None)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_spark_options(p)
    p.set_defaults(func=_sendout)


def _dns(servers: list[str]) -> Any:
    from sluice.pipeline.domains import DnsSettings

    hosts: list[str] = []
    ports: set[int] = set()
    for item in servers:
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit():
            host, port = item, "53"
        hosts.append(host.strip("[]"))
        ports.add(int(port))
    if len(ports) > 1:
        raise CommandError("--dns-server: every server must use the same port", status=2)
    return DnsSettings(tuple(hosts), ports.pop() if ports else 53)


def _sendout(args: argparse.Namespace) -> int:
    from sluice.api.client import base_url, default_token

    cfg = load(args)
    for name in ("batch_size", "concurrency", "rows_per_task"):
        if getattr(args, name) < 1:
            raise CommandError(f"--{name.replace('_', '-')} must be at least 1", status=2)
    token = args.token or os.environ.get("SLUICE_API_TOKEN") or default_token(cfg)
    if not token and not args.dry_run:
        raise CommandError("no API token: give --token, set SLUICE_API_TOKEN, or list one in "
                           "api.tokens", status=2)
    suppression = args.suppression or cfg.suppression.path
    if suppression == "none":
        suppression = None
    dns = _dns(args.dns_server) if args.check_domains else None
    show = not args.no_progress and sys.stderr.isatty()

    def precheck() -> None:
        from sluice.pipeline.extract import expand_inputs

        expand_inputs(args.input)

    def work(spark: Any, step: Any) -> Any:
        from sluice.pipeline.progress import CountProgress
        from sluice.pipeline.sendout_job import run_sendout

        with CountProgress(enabled=show) as counts:
            return run_sendout(
                spark, args.input, args.output, template=args.template, job=args.job,
                sender=args.sender, tenant=args.tenant, api_url=args.api or base_url(cfg),
                token=token or "", address_column=args.address_column, fmt=args.fmt,
                suppression=suppression, dns=dns, domain_cache=args.domain_cache,
                priority=args.priority, batch_size=args.batch_size,
                concurrency=args.concurrency, rows_per_task=args.rows_per_task,
                dry_run=args.dry_run, step=step, progress=counts.follow)

    result = run_in_spark(args, "sluice-sendout", work, precheck)
    if isinstance(result, int):
        return result
    print_results(result)
    return 0
