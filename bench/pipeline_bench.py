"""Benchmark of the Spark pipeline: report + bounces over 1M and 10M events.

Usage:
    .venv/bin/python bench/pipeline_bench.py [--sizes 1000000,10000000]
        [--master local[*]] [--workdir /tmp/sluice-pipeline-bench] [--keep]
        [--driver-memory 4g] [--no-duckdb] [--parquet [--reuse-table]] [--runs N]

What it does, per size N:
  1. generates N accounting events as JSON lines, in exactly the format
     sluice.accounting writes (the keys of EVENT_FIELDS, ISO times with ms
     and Z, nulls where the queue writes nulls), with DuckDB's vectorised
     SQL engine: a realistic mix (Zipf-like domains with their MX hosts,
     tenants, jobs, source IPs, outcomes, provider-style replies with ids
     and addresses in them).  Generation is timed separately and NOT part
     of the pipeline figures;
  2. runs report + bounces over one read of the JSON files
     (sluice.pipeline.jobs.run_jobs, i.e. `sluice analytics all --jobs
     report,bounces`) with Spark on the given master.  Timed: from reading
     the JSON to the last Parquet/CSV/HTML file written, in one
     SparkSession (its start-up is reported once and not counted).  With
     --separate, also the two jobs as two runs that each read the JSON;
  3. runs the same aggregations in DuckDB on the same files (single-node
     reference): outcome grouping sets with percentiles, masked reasons,
     and the bounce classification from the same rule table.

With --parquet the JSON is first ingested (sluice.pipeline.ingest, timed
apart) and both engines read that Parquet table instead; goal: Spark at
most 2x DuckDB's time.  The table stores each failure's masked reply
(masked once, by Spark, at ingest): both engines group and classify by
that column and neither runs a masking rule.  --runs N interleaves N runs
of each and reports medians.

What each timed side does.  Spark: run_jobs(report, bounces) as the CLI
runs it -- every table written as Parquet and CSV, the HTML page, the
classified failures as Parquet -- in a session already started (the
start-up is printed and not counted; the first run of a session does
include the JVM's JIT warm-up and every query's planning and code
generation).  DuckDB: reads the table into a temporary table, computes
the same tables (the four outcome levels from grouping sets with
percentiles, the top reasons overall and per domain, the clients, every
failure classified -- each distinct masked reason once, as Spark does --
and the bounce summary) and writes each of them as Spark does, under
WORKDIR/duck-N: Parquet (by day where Spark partitions by day) and CSV
with a header, the classified failures as Parquet only.  Only the HTML
page (a few KB from the totals) is Spark's alone.

Prints one line per measurement and a summary with events/s.  Goal: 10M
events through report + bounces in under 2 minutes on the project's
2-core machine.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from sluice.accounting import EVENT_FIELDS  # noqa: E402
from sluice.pipeline import rules  # noqa: E402

DOMAINS = [
    ("gmail.com", "gmail-smtp-in.l.google.com", 30),
    ("yahoo.com", "mta7.am0.yahoodns.net", 10),
    ("outlook.com", "outlook-com.olc.protection.outlook.com", 10),
    ("hotmail.com", "hotmail-com.olc.protection.outlook.com", 6),
    ("icloud.com", "mx01.mail.icloud.com", 5),
    ("gmx.de", "mx00.emig.gmx.net", 3),
    ("web.de", "mx-ha03.web.de", 3),
    ("orange.fr", "smtp-in.orange.fr", 2),
]
# A long tail of business domains, each with its own MX.
TAIL = 2000
# Top reasons kept per event kind (and per domain): the report's default.
TOP = 10

# (kind, share %, code, enhanced, response template; {a} = address, {n} = number, {h} = hex id)
OUTCOMES = [
    ("received", 44.0, None, None, None),
    ("delivered", 38.0, 250, "2.0.0", "OK {n} {h}.{n} - gsmtp"),
    ("deferred", 5.0, 421, "4.7.0", "[TSS04] Messages from 192.0.2.{n} temporarily deferred "
                                    "due to unexpected volume or user complaints"),
    ("deferred", 3.0, 452, "4.2.2", "The email account that you tried to reach is over quota. "
                                    "{h} - gsmtp"),
    ("deferred", 2.5, 451, "4.7.1", "<{a}>: Recipient address rejected: Greylisted for {n} "
                                    "seconds"),
    ("deferred", 1.5, None, "4.4.1", "connect to mx.example.net[198.51.100.{n}]:25: "
                                     "Connection timed out"),
    ("bounced", 3.0, 550, "5.1.1", "The email account that you tried to reach does not exist. "
                                   "{h} - gsmtp"),
    ("bounced", 0.8, 550, "5.7.1", "Service unavailable; Client host [192.0.2.{n}] blocked "
                                   "using zen.spamhaus.org"),
    ("bounced", 0.4, 554, "5.7.9", "Message not accepted for policy reasons. {h}"),
    ("bounced", 0.3, 552, "5.2.2", "<{a}>: mailbox full"),
    ("expired", 1.5, 421, "4.7.0", "Try again later, closing connection. {h}"),
]


def _sql_str(text: str | None) -> str:
    return "NULL" if text is None else "'" + text.replace("'", "''") + "'"


def generate(con: object, n: int, out_dir: Path) -> None:
    """N events as JSON lines under out_dir (several files, as rotation makes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cum = 0.0
    kind_cases, code_cases, enh_cases, resp_cases = [], [], [], []
    for kind, share, code, enhanced, response in OUTCOMES:
        lo, cum = cum, cum + share
        cond = f"u_kind >= {lo / 100:.6f} AND u_kind < {cum / 100:.6f}"
        kind_cases.append(f"WHEN {cond} THEN '{kind}'")
        code_cases.append(f"WHEN {cond} THEN {code if code is not None else 'NULL'}")
        enh_cases.append(f"WHEN {cond} THEN {_sql_str(enhanced)}")
        if response is None:
            resp_cases.append(f"WHEN {cond} THEN NULL")
        else:
            parts = []
            for chunk in response.replace("{a}", "\x00a\x00").replace("{n}", "\x00n\x00") \
                    .replace("{h}", "\x00h\x00").split("\x00"):
                if chunk == "a":
                    parts.append("recipient")
                elif chunk == "n":
                    parts.append("CAST(h3 % 1000 AS VARCHAR)")
                elif chunk == "h":
                    parts.append("printf('%016x', h2)")
                elif chunk:
                    parts.append(_sql_str(chunk))
            resp_cases.append(f"WHEN {cond} THEN concat({', '.join(parts)})")
    total_w = sum(w for _, _, w in DOMAINS) + 30
    dom_cases, mx_cases = [], []
    cum = 0.0
    for dom, mx, w in DOMAINS:
        lo, cum = cum, cum + w / total_w
        dom_cases.append(f"WHEN u_dom >= {lo:.6f} AND u_dom < {cum:.6f} THEN '{dom}'")
        mx_cases.append(f"WHEN u_dom >= {lo:.6f} AND u_dom < {cum:.6f} THEN '{mx}'")
    # Zipf-like long tail: a few business domains get most of the tail's mail.
    tail_idx = f"CAST(floor({TAIL} * pow((h4 % 1000003) / 1000003.0, 3)) AS INTEGER)"
    tail_dom = f"'biz' || CAST({tail_idx} AS VARCHAR) || '.example'"
    tail_mx = f"'mx' || CAST(h3 % 2 AS VARCHAR) || '.biz' || CAST({tail_idx} AS VARCHAR) " \
              "|| '.example'"
    base = f"""
        SELECT i,
               hash(i) AS h1, hash(i + 1000000007) AS h2, hash(i * 31 + 7) AS h3,
               hash(i * 17 + 3) AS h4,
               (hash(i) % 1000003) / 1000003.0 AS u_kind,
               (hash(i * 13 + 5) % 1000003) / 1000003.0 AS u_dom,
               (hash(i * 29 + 11) % 1000003) / 1000003.0 AS u_age
        FROM range({n}) t(i)
    """
    with_kind = f"""
        SELECT *, CASE {' '.join(kind_cases)} ELSE 'received' END AS event,
               CASE {' '.join(dom_cases)} ELSE {tail_dom} END AS domain,
               CASE {' '.join(mx_cases)} ELSE {tail_mx} END AS mx
        FROM ({base})
    """
    # Campaigns: each hour has 8 jobs running; a job belongs to one of 20
    # tenants, and a tenant sends from its own pair of source IPs.
    with_rcpt = f"""
        SELECT *, 'user' || CAST(h1 % 5000000 AS VARCHAR) || '@' || domain AS recipient,
               CAST((i * 24 // {n}) * 8 + h2 % 8 AS INTEGER) AS job
        FROM ({with_kind})
    """
    attempt_kinds = "('delivered','deferred','bounced')"
    query = f"""
        SELECT
          strftime(TIMESTAMP '2026-11-20 00:00:00'
                   + to_milliseconds(CAST(i * 86400000 // {n} AS BIGINT)),
                   '%Y-%m-%dT%H:%M:%S.%gZ') AS time,
          event,
          'node' || CAST(h3 % 2 AS VARCHAR) AS node,
          printf('%012X', i // 2) || '-' || CAST(i % 2 AS VARCHAR) AS qid,
          printf('%012X', i // 2) AS spid,
          'news@tenant' || CAST(job % 20 AS VARCHAR) || '.test' AS sender,
          recipient,
          domain,
          't' || CAST(job % 20 AS VARCHAR) AS tenantid,
          'job' || CAST(job AS VARCHAR) AS jobid,
          '' AS transportid,
          '192.0.2.' || CAST(1 + (job % 20) * 2 + h3 % 2 AS VARCHAR) AS localip,
          CASE WHEN event IN {attempt_kinds} THEN mx END AS remotemx,
          CASE WHEN event IN {attempt_kinds}
               THEN '203.0.113.' || CAST(h4 % 250 AS VARCHAR) END AS remoteip,
          CASE WHEN event = 'received' THEN 0 ELSE 1 + CAST(h3 % 3 AS INTEGER) END AS attempt,
          CASE {' '.join(code_cases)} END AS code,
          CASE {' '.join(enh_cases)} END AS enhanced,
          CASE {' '.join(resp_cases)} END AS response,
          CASE WHEN event = 'received' THEN 0.0
               ELSE round(exp(u_age * 9.0) - 1.0, 3) END AS queue_age_s,
          CAST(2000 + h2 % 80000 AS BIGINT) AS size,
          CASE WHEN event IN {attempt_kinds}
               THEN round(0.05 + (h4 % 3000) / 1000.0, 4) END AS duration_s,
          false AS is_report,
          -- The receiving session's fields: set on received and session
          -- events by a live node, null in this mix (no job reads them).
          CAST(NULL AS VARCHAR) AS client_ip, CAST(NULL AS VARCHAR) AS helo,
          CAST(NULL AS VARCHAR) AS tls_protocol, CAST(NULL AS VARCHAR) AS tls_cipher,
          CAST(NULL AS VARCHAR) AS auth_user, CAST(NULL AS VARCHAR) AS refused,
          CAST(NULL AS INTEGER) AS auth_failures, CAST(NULL AS VARCHAR) AS tls_failure
        FROM ({with_rcpt})
    """
    con.execute(  # type: ignore[attr-defined]
        f"COPY ({query}) TO '{out_dir}' (FORMAT JSON, PER_THREAD_OUTPUT true)"
    )


def check_format(out_dir: Path) -> None:
    import json

    first = next(iter(sorted(out_dir.glob("*.json"))))
    with first.open() as fh:
        line = json.loads(fh.readline())
    if tuple(line) != EVENT_FIELDS:
        raise SystemExit(f"generated keys {tuple(line)} differ from EVENT_FIELDS")


def duckdb_reference(con: object, files: str, parquet: str | None = None,
                     out_dir: Path | None = None) -> float:
    """The same aggregations in DuckDB over the JSON ``files`` or, when given, the
    ``parquet`` table ingest wrote; returns seconds.  With ``out_dir``, every
    table is written there as Spark's jobs write theirs (see _duckdb_write)."""
    cols = ", ".join(
        f"'{f}': '{t}'" for f, t in (
            ("time", "TIMESTAMPTZ"), ("event", "VARCHAR"), ("node", "VARCHAR"),
            ("qid", "VARCHAR"), ("spid", "VARCHAR"), ("sender", "VARCHAR"),
            ("recipient", "VARCHAR"), ("domain", "VARCHAR"), ("tenantid", "VARCHAR"),
            ("jobid", "VARCHAR"), ("transportid", "VARCHAR"), ("localip", "VARCHAR"),
            ("remotemx", "VARCHAR"), ("remoteip", "VARCHAR"), ("attempt", "INTEGER"),
            ("code", "INTEGER"), ("enhanced", "VARCHAR"), ("response", "VARCHAR"),
            ("queue_age_s", "DOUBLE"), ("size", "BIGINT"), ("duration_s", "DOUBLE"),
            ("is_report", "BOOLEAN"), ("client_ip", "VARCHAR"), ("helo", "VARCHAR"),
            ("tls_protocol", "VARCHAR"), ("tls_cipher", "VARCHAR"), ("auth_user", "VARCHAR"),
            ("refused", "VARCHAR"), ("auth_failures", "INTEGER"), ("tls_failure", "VARCHAR"))
    )
    masked = "coalesce(response, '')"
    for pattern, repl, _guard in rules.MASK_RULES:
        if "(?=" in pattern or "(?<" in pattern:  # RE2 has no lookaround: DuckDB skips them
            continue
        repl = re.sub(r"\$(\d)", r"\\\1", repl)  # Java's $1 is RE2's \1
        # RE2 never backtracks, so it has no possessive quantifiers: ++ is +.
        pattern = re.sub(r"(?<!\\)([+*?}])\+", r"\1", pattern)
        masked = f"regexp_replace({masked}, {_sql_str(pattern)}, {_sql_str(repl)}, 'g')"
    cases = []
    for rule in rules.BOUNCE_RULES:
        conds = []
        if rule.event is not None:
            conds.append(f"event = '{rule.event}'")
        if rule.enhanced is not None:
            conds.append(f"regexp_full_match(coalesce(enhanced, ''), {_sql_str(rule.enhanced)})")
        if rule.text is not None:
            conds.append(f"regexp_matches(masked, {_sql_str(rule.text)})")
        cases.append(f"WHEN {' AND '.join(conds)} THEN '{rule.category}'")
    hard = ", ".join(f"'{c}'" for c in sorted(str(c) for c in rules.HARD_CATEGORIES))
    started = time.monotonic()
    if parquet is None:
        source = (f"SELECT * FROM read_json('{files}', format='newline_delimited', "
                  f"columns={{{cols}}})")
    else:
        # The table ingest wrote stores each failure's masked reply (made
        # by Spark's Java regexes, look-arounds included): both engines
        # group and classify by that column and neither masks.
        masked = "masked_reply"
        source = (f"SELECT {', '.join(EVENT_FIELDS)}, masked_reply "
                  f"FROM read_parquet('{parquet}/*/*.parquet', hive_partitioning=true)")
    if out_dir is not None:
        shutil.rmtree(out_dir, ignore_errors=True)  # as Spark's overwrite, inside the time
        out_dir.mkdir(parents=True)
    con.execute(f"CREATE OR REPLACE TEMP TABLE ev AS {source}")  # type: ignore[attr-defined]
    con.execute("""
        CREATE OR REPLACE TEMP TABLE outcomes AS
        SELECT *, CASE WHEN delivered + bounced + expired > 0
                       THEN delivered / (delivered + bounced + expired) END AS delivery_rate
        FROM (SELECT GROUPING(domain, tenantid, jobid, localip, remotemx, hour) AS gid,
                     domain, tenantid, jobid, localip, remotemx, hour,
                     count(*) FILTER (event = 'received') AS received,
                     count(*) FILTER (event = 'delivered') AS delivered,
                     count(*) FILTER (event = 'deferred') AS deferred,
                     count(*) FILTER (event = 'bounced') AS bounced,
                     count(*) FILTER (event = 'expired') AS expired,
                     approx_quantile(queue_age_s, [0.5, 0.95, 0.99])
                         FILTER (event = 'delivered') AS pct,
                     avg(attempt) FILTER (event = 'delivered') AS attempts_per_delivered
              FROM (SELECT *, date_trunc('hour', time) AS hour FROM ev
                    WHERE event <> 'session')
              GROUP BY GROUPING SETS ((domain, tenantid, jobid, localip, remotemx, hour),
                                      (hour), (domain), ()))
    """)  # type: ignore[attr-defined]
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE failures AS
        SELECT *, {masked} AS masked FROM ev WHERE event IN ('deferred', 'bounced', 'expired')
    """)  # type: ignore[attr-defined]
    dropped = "masked" if parquet is None else "masked, masked_reply"
    # Classified as Spark's jobs do it: each distinct (event, enhanced code,
    # masked reply) once, joined back to the failures.
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE categories AS
        SELECT *, CASE {' '.join(cases)} ELSE 'other' END AS category
        FROM (SELECT DISTINCT event, coalesce(enhanced, '') AS enhanced, masked
              FROM failures);
        CREATE OR REPLACE TEMP TABLE classified AS
        SELECT f.* EXCLUDE ({dropped}), c.category,
               c.category IN ({hard}) AND f.event = 'bounced' AS hard,
               concat_ws(' ', CAST(f.code AS VARCHAR), nullif(f.enhanced, ''),
                         nullif(f.masked, '')) AS reason
        FROM failures f JOIN categories c
          ON f.event = c.event AND coalesce(f.enhanced, '') = c.enhanced
             AND f.masked IS NOT DISTINCT FROM c.masked
    """)  # type: ignore[attr-defined]
    con.execute("""
        CREATE OR REPLACE TEMP TABLE reasons AS
        SELECT event, domain, reason, count(*) AS count, min(response) AS example
        FROM classified GROUP BY ALL
    """)  # type: ignore[attr-defined]
    # What the report makes of the reasons and the bounces job of the
    # categories, as Spark's jobs do (top reasons overall and per domain,
    # hard or soft, distinct recipients, the clients table).
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE reasons_top AS
        SELECT event, rank, reason, count, example FROM (
            SELECT *, row_number() OVER (PARTITION BY event ORDER BY count DESC, reason) AS rank
            FROM (SELECT event, reason, CAST(sum(count) AS BIGINT) AS count,
                         min(example) AS example
                  FROM reasons GROUP BY ALL))
        WHERE rank <= {TOP} ORDER BY event, rank;
        CREATE OR REPLACE TEMP TABLE reasons_by_domain AS
        SELECT event, domain, rank, reason, count, example FROM (
            SELECT *, row_number() OVER (PARTITION BY event, domain
                                         ORDER BY count DESC, reason) AS rank
            FROM reasons)
        WHERE rank <= {TOP} ORDER BY event, domain, rank
    """)  # type: ignore[attr-defined]
    con.execute("""
        CREATE OR REPLACE TEMP TABLE bounce_summary AS
        SELECT domain, event, category, hard, count(*) AS count,
               approx_count_distinct(lower(recipient)) AS recipients
        FROM classified GROUP BY ALL ORDER BY count DESC, domain, event, category
    """)  # type: ignore[attr-defined]
    con.execute("""
        CREATE OR REPLACE TEMP TABLE clients AS
        SELECT client_ip, auth_user, tls_protocol,
               count(*) FILTER (event = 'session') AS connections,
               coalesce(sum(auth_failures) FILTER (event = 'session'), 0) AS auth_failures,
               count(*) FILTER (event = 'session' AND tls_failure IS NOT NULL) AS tls_failures,
               count(DISTINCT spid) FILTER (event = 'received') AS messages,
               count(*) FILTER (event = 'received') AS recipients
        FROM ev WHERE event IN ('received', 'session') AND client_ip IS NOT NULL
        GROUP BY ALL ORDER BY recipients DESC, connections DESC, client_ip, auth_user,
                              tls_protocol
    """)  # type: ignore[attr-defined]
    if out_dir is not None:
        _duckdb_write(con, out_dir)
    return time.monotonic() - started


#: The report's outcome levels: the grouping id of their set, their key columns.
_LEVELS = {
    "outcomes_hourly": (0, "hour, domain, tenantid, jobid, localip, remotemx"),
    "outcomes_by_hour": (62, "hour"),
    "outcomes_by_domain": (31, "domain"),
    "outcomes_total": (63, ""),
}
_MEASURES = ("received, delivered, deferred, bounced, expired, delivery_rate, "
             "pct[1] AS queue_p50_s, pct[2] AS queue_p95_s, pct[3] AS queue_p99_s, "
             "attempts_per_delivered")


def _duckdb_write(con: object, out: Path) -> None:
    """Every table Spark's report + bounces write, as they write it: Parquet
    (by day where Spark partitions by day) and CSV with a header; the
    classified failures as Parquet only."""
    def copy(query: str, name: str, by_day: bool = False, csv: bool = True) -> None:
        if by_day:
            con.execute(  # type: ignore[attr-defined]
                f"COPY (SELECT *, CAST({by_day_of[name]} AS DATE) AS day FROM ({query})) "
                f"TO '{out / (name + '.parquet')}' (FORMAT PARQUET, PARTITION_BY (day))")
        else:
            con.execute(  # type: ignore[attr-defined]
                f"COPY ({query}) TO '{out / (name + '.parquet')}' (FORMAT PARQUET)")
        if csv:
            con.execute(  # type: ignore[attr-defined]
                f"COPY ({query}) TO '{out / (name + '.csv')}' (FORMAT CSV, HEADER)")

    by_day_of = {"outcomes_hourly": "hour", "outcomes_by_hour": "hour", "bounces": "time"}
    for name, (gid, keys) in _LEVELS.items():
        order = f" ORDER BY {keys}" if keys and name != "outcomes_hourly" else ""
        cols = f"{keys}, {_MEASURES}" if keys else _MEASURES
        copy(f"SELECT {cols} FROM outcomes WHERE gid = {gid}{order}", name,
             by_day=name in by_day_of)
    for name in ("reasons_top", "reasons_by_domain", "clients", "bounce_summary"):
        copy(f"SELECT * FROM {name}", name)
    copy("SELECT * FROM classified", "bounces", by_day=True, csv=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,10000000")
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--driver-memory", default="4g")
    parser.add_argument("--workdir", default="/tmp/sluice-pipeline-bench")
    parser.add_argument("--keep", action="store_true", help="keep the generated data")
    parser.add_argument("--no-duckdb", action="store_true")
    parser.add_argument("--parquet", action="store_true",
                        help="ingest the JSON into a Parquet table by day first (timed apart), "
                             "then time Spark and DuckDB over that table")
    parser.add_argument("--reuse-table", action="store_true",
                        help="with --parquet and --keep: read the table an earlier run "
                             "ingested, if there is one, instead of ingesting again")
    parser.add_argument("--runs", type=int, default=1,
                        help="Spark and DuckDB runs per size, interleaved; medians printed")
    parser.add_argument("--separate", action="store_true",
                        help="also time report and bounces as two separate runs")
    args = parser.parse_args()
    sizes = [int(s.replace("_", "")) for s in args.sizes.split(",")]

    import duckdb

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect()
    con.execute("SET preserve_insertion_order = false")
    datasets = {}
    for n in sizes:
        out = work / f"events-{n}"
        if not (out.exists() and any(out.glob("*.json"))):
            shutil.rmtree(out, ignore_errors=True)
            started = time.monotonic()
            generate(con, n, out)
            took = time.monotonic() - started
            size_mb = sum(f.stat().st_size for f in out.glob("*.json")) / 1e6
            print(f"generate n={n} files={len(list(out.glob('*.json')))} size_mb={size_mb:.0f} "
                  f"seconds={took:.1f} (DuckDB, not part of the pipeline figures)", flush=True)
        check_format(out)
        datasets[n] = out

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from sluice.pipeline.jobs import run_bounces, run_jobs, run_report
        from sluice.pipeline.session import build_session

        started = time.monotonic()
        spark = build_session(args.master, app_name="sluice-bench",
                              driver_memory=args.driver_memory)
        spark.range(1).count()
        print(f"spark start master={args.master} cores={os.cpu_count()} "
              f"seconds={time.monotonic() - started:.1f} (not counted)", flush=True)
        results = []
        for n, data in datasets.items():
            files = str(data / "*.json")
            inputs = [files]
            table = None
            if args.parquet:
                from sluice.pipeline.ingest import run_ingest

                table = str(work / f"table-{n}")
                if args.reuse_table and (Path(table) / "_SUCCESS").exists():
                    print(f"ingest n={n} reusing {table}", flush=True)
                else:
                    shutil.rmtree(table, ignore_errors=True)
                    load_before = os.getloadavg()[0]
                    ingested = run_ingest(spark, [files], table)
                    print(f"ingest n={n} seconds={ingested.elapsed_s:.1f} "
                          f"events_added={ingested.counts['events_added']} "
                          f"loadavg_before={load_before:.1f} (not part of the report figures)",
                          flush=True)
                inputs = [table]
            out = work / f"out-{n}"
            sparks: list[float] = []
            ducks: list[float] = []
            for run in range(args.runs):
                load_before = os.getloadavg()[0]
                started = time.monotonic()
                report, bounces = run_jobs(spark, inputs, str(out), ["report", "bounces"])
                total = time.monotonic() - started
                sparks.append(total)
                assert report.counts["received"] is not None
                print(f"spark n={n} run={run + 1} input={'parquet' if table else 'json'} "
                      f"report_s={report.elapsed_s:.1f} bounces_s={bounces.elapsed_s:.1f} "
                      f"total_s={total:.1f} events_per_s={n / total:,.0f} "
                      f"loadavg_before={load_before:.1f} "
                      f"loadavg_after={os.getloadavg()[0]:.1f}", flush=True)
                if not args.no_duckdb:
                    load_before = os.getloadavg()[0]
                    duck = duckdb_reference(con, files, table, work / f"duck-{n}")
                    ducks.append(duck)
                    print(f"duckdb n={n} run={run + 1} seconds={duck:.1f} "
                          f"events_per_s={n / duck:,.0f} loadavg_before={load_before:.1f}",
                          flush=True)
            if args.separate:
                started = time.monotonic()
                run_report(spark, inputs, str(out / "r"))
                run_bounces(spark, inputs, str(out / "b"))
                separate = time.monotonic() - started
                print(f"spark n={n} mode=separate (report, then bounces, each reading it) "
                      f"total_s={separate:.1f} events_per_s={n / separate:,.0f}", flush=True)
            results.append((n, statistics.median(sparks),
                            statistics.median(ducks) if ducks else None))
        spark.stop()

    what = "the ingested Parquet table" if args.parquet else "JSON lines"
    print(f"\nsummary (report + bounces over one read of {what}, medians of {args.runs}; "
          f"load now {os.getloadavg()[0]:.1f}; Spark's start-up not counted, its first run "
          "warms the JVM; both write every table):")
    for n, total, duck_s in results:
        verdict = ""
        if n >= 10_000_000:
            verdict = " goal <120 s: " + ("met" if total < 120 else "NOT met")
        duck = ""
        if duck_s is not None:
            duck = f", DuckDB {duck_s:.1f} s, Spark/DuckDB {total / duck_s:.1f}x"
            if args.parquet:
                duck += " (goal <= 2x: " + ("met" if total <= 2 * duck_s else "NOT met") + ")"
        print(f"  {n:>11,} events: Spark {total:6.1f} s = {n / total:>9,.0f} events/s{duck}"
              f"{verdict}")
    if len(results) >= 2:
        (n1, t1, _), (n2, t2, _) = results[0], results[-1]
        print(f"  scaling: {n2 / n1:.0f}x the events took {t2 / t1:.1f}x the time")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
