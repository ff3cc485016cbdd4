"""sluice.pipeline: the accounting log on Apache Spark (the ``analytics`` extra).

SUMMARY
    from sluice.pipeline import build_session, read_events, outcomes, ...
    sluice analytics report|bounces|suppress|shape|maillog ...

DESCRIPTION
    PySpark jobs over the accounting log that every queue transition writes
    (sluice.accounting): delivery reports, bounce classification, the
    suppression list the queue reads back, shaping advice as a pickup
    policy, and a reader for Postfix maillogs that yields the same events.

    Extract (extract), transform (events, report, bounces, suppress, shape,
    maillog -- pure DataFrame -> DataFrame functions with explicit
    schemas, chainable with DataFrame.transform) and load (load) are kept
    apart; jobs chains them per command.  rules, policy and html are plain
    Python that the Spark side builds on.

    Importing this package needs PySpark (``pip install
    'sluice-mta[analytics]'``) and, to run anything, Java 17 or later.

SEE ALSO
    docs/analytics.md, sluice.suppression
"""

from __future__ import annotations

from sluice.pipeline.bounces import bounce_summary, classify_failures
from sluice.pipeline.events import between, conform_events, normalise_events, parse_when
from sluice.pipeline.extract import InputError, expand_inputs, read_events, read_lines
from sluice.pipeline.jobs import (
    JobResult,
    run_bounces,
    run_maillog,
    run_report,
    run_shape,
    run_suppress,
)
from sluice.pipeline.maillog import maillog_events, parse_lines
from sluice.pipeline.report import Level, level, outcomes, reasons, top_reasons
from sluice.pipeline.schema import (
    CLASSIFIED_SCHEMA,
    EVENT_SCHEMA,
    RAW_EVENT_SCHEMA,
    SUPPRESSION_SCHEMA,
)
from sluice.pipeline.session import build_session, pipeline_session
from sluice.pipeline.shape import throttle_findings
from sluice.pipeline.suppress import last_delivered, suppressions

__all__ = [
    "CLASSIFIED_SCHEMA",
    "EVENT_SCHEMA",
    "RAW_EVENT_SCHEMA",
    "SUPPRESSION_SCHEMA",
    "InputError",
    "JobResult",
    "Level",
    "between",
    "bounce_summary",
    "build_session",
    "classify_failures",
    "conform_events",
    "expand_inputs",
    "last_delivered",
    "level",
    "maillog_events",
    "normalise_events",
    "outcomes",
    "parse_lines",
    "parse_when",
    "pipeline_session",
    "read_events",
    "read_lines",
    "reasons",
    "run_bounces",
    "run_maillog",
    "run_report",
    "run_shape",
    "run_suppress",
    "suppressions",
    "throttle_findings",
    "top_reasons",
]
