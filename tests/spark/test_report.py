"""The report job's transforms on small inline frames."""

from __future__ import annotations

import re

import pytest
from pyspark.sql.types import (
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from sluice.pipeline.html import ReportData, render_report
from sluice.pipeline.report import (
    MEASURES,
    Level,
    largest_domains,
    level,
    outcomes,
    reasons,
    top_reasons,
)
from tests.spark.frames import T0, assert_df_equal, event

pytestmark = pytest.mark.spark

MEASURE_FIELDS = [
    StructField("received", LongType()),
    StructField("delivered", LongType()),
    StructField("deferred", LongType()),
    StructField("bounced", LongType()),
    StructField("expired", LongType()),
    StructField("delivery_rate", DoubleType()),
    StructField("queue_p50_s", DoubleType()),
    StructField("queue_p95_s", DoubleType()),
    StructField("queue_p99_s", DoubleType()),
    StructField("attempts_per_delivered", DoubleType()),
]


@pytest.fixture(scope="module")
def sample(spark):
    rows = [
        # example.com: three delivered (one after a deferral), one bounce
        event("received", "a@example.com", 0),
        event("received", "b@example.com", 1),
        event("received", "c@example.com", 2),
        event("received", "d@example.com", 3),
        event("delivered", "a@example.com", 10, queue_age_s=10.0),
        event("deferred", "b@example.com", 20, code=451, enhanced="4.7.1",
              response="<b@example.com>: greylisted for 300 seconds, id 9F3A22B0C1"),
        event("delivered", "b@example.com", 3700, queue_age_s=3699.0, attempt=2),
        event("delivered", "c@example.com", 30, queue_age_s=28.0),
        event("bounced", "d@example.com", 40, code=550, enhanced="5.1.1",
              response="<d@example.com>: user unknown"),
        # example.org: one expired after a deferral, another deferral
        event("received", "e@example.org", 5, tenantid="t2"),
        event("deferred", "e@example.org", 50, tenantid="t2", code=451, enhanced="4.7.1",
              response="<e@example.org>: greylisted for 600 seconds, id 77AB01CD99",
              remotemx="mx.example.org"),
        event("expired", "e@example.org", 3605, tenantid="t2", code=451, enhanced="4.7.1",
              response="gave up", remotemx=None, remoteip=None),
    ]
    from sluice.accounting import EVENT_FIELDS
    from sluice.pipeline.schema import EVENT_SCHEMA

    df = spark.createDataFrame([tuple(r[f] for f in EVENT_FIELDS) for r in rows], EVENT_SCHEMA)
    out = outcomes(df).cache()
    yield df, out
    out.unpersist()


def test_per_domain_level(spark, sample):
    _, out = sample
    schema = StructType([StructField("domain", StringType()), *MEASURE_FIELDS])
    expected = spark.createDataFrame(
        [
            ("example.com", 4, 3, 1, 1, 0, 0.75, 28.0, 3699.0, 3699.0, 4 / 3),
            ("example.org", 1, 0, 1, 0, 1, 0.0, None, None, None, None),
        ],
        schema,
    )
    assert_df_equal(level(out, Level.DOMAIN), expected)


def test_levels_add_up_to_the_total(spark, sample):
    _, out = sample
    total = level(out, Level.TOTAL).collect()
    assert len(total) == 1
    t = total[0].asDict()
    assert (t["received"], t["delivered"], t["deferred"], t["bounced"], t["expired"]) == (
        5, 3, 2, 1, 1)
    assert t["delivery_rate"] == pytest.approx(3 / 5)
    counts = ["received", "delivered", "deferred", "bounced", "expired"]
    for which in (Level.HOURLY, Level.HOUR, Level.DOMAIN):
        sums = level(out, which).groupBy().sum(*counts).collect()[0]
        assert [sums[f"sum({c})"] for c in counts] == [t[c] for c in counts], which


def test_hourly_detail_keeps_every_dimension(sample):
    _, out = sample
    hourly = level(out, Level.HOURLY)
    assert hourly.columns == ["hour", "domain", "tenantid", "jobid", "localip", "remotemx",
                              *MEASURES]
    cells = {(r.domain, r.tenantid, r.remotemx, r.hour.hour): (r.received, r.delivered)
             for r in hourly.collect()}
    # b@example.com was delivered an hour later than it came in
    assert cells[("example.com", "t1", None, 10)] == (4, 0)
    assert cells[("example.com", "t1", "mx1.example.com", 10)] == (0, 2)
    assert cells[("example.com", "t1", "mx1.example.com", 11)] == (0, 1)


def test_reasons_are_masked_and_grouped(spark, sample):
    df, _ = sample
    top = top_reasons(reasons(df), 5)
    expected = spark.createDataFrame(
        [
            ("bounced", 1, "550 5.1.1 <addr>: user unknown", 1),
            ("deferred", 1, "451 4.7.1 <addr>: greylisted for <n> seconds, id <id>", 2),
            ("expired", 1, "451 4.7.1 gave up", 1),
        ],
        "event string, rank int, reason string, count long",
    )
    assert_df_equal(top.drop("example"), expected, checkRowOrder=True)
    per_domain = top_reasons(reasons(df), 1, by_domain=True)
    assert {(r.event, r.domain) for r in per_domain.collect()} == {
        ("bounced", "example.com"), ("deferred", "example.com"),
        ("deferred", "example.org"), ("expired", "example.org")}


def test_largest_domains_by_attempts_and_by_deliveries(spark):
    # a: most attempts, none delivered; b: most delivered; c and d tie on
    # attempts (the name decides); e is in neither top two.
    rows = [("a", 0, 9, 0, 0), ("b", 5, 0, 0, 0), ("c", 3, 1, 0, 0), ("d", 2, 0, 2, 0),
            ("e", 1, 0, 0, 1)]
    by_domain = spark.createDataFrame(
        rows, "domain string, delivered long, deferred long, bounced long, expired long")
    assert sorted(r.domain for r in largest_domains(by_domain, 1).collect()) == ["a", "b"]
    assert sorted(r.domain for r in largest_domains(by_domain, 2).collect()) == ["a", "b", "c"]
    assert largest_domains(by_domain, 2).columns == by_domain.columns


def test_html_report_shows_the_numbers(sample):
    _, out = sample
    from sluice.pipeline.load import rows

    data = ReportData(
        generated_at="2026-11-22T00:00:00.000Z",
        totals=rows(level(out, Level.TOTAL))[0],
        by_hour=rows(level(out, Level.HOUR)),
        by_domain=rows(level(out, Level.DOMAIN)),
        reasons=[{"event": "bounced", "rank": 1, "reason": "550 <script>x</script>",
                  "count": 1, "example": "e"}],
        inputs=["/var/log/sluice-acct-x.jsonl"],
    )
    page = render_report(data)
    assert "<script>" not in page  # data is escaped
    assert re.search(r"class=total-received>5<", page)
    assert re.search(r"class=total-rate>60\.0 %<", page)
    assert page.count('<polyline class="series') == 5
    assert page.count("<rect class=\"seg delivered\"") == 1  # example.org delivered nothing
    assert 'class="pct p99"' in page


@pytest.mark.integration
def test_html_report_renders_in_chromium(sample, tmp_path):
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed")
    sync_api = pytest.importorskip("playwright.sync_api")
    from sluice.pipeline.load import rows

    _, out = sample
    page_file = tmp_path / "report.html"
    page_file.write_text(render_report(ReportData(
        generated_at="2026-11-22T00:00:00.000Z",
        totals=rows(level(out, Level.TOTAL))[0],
        by_hour=rows(level(out, Level.HOUR)),
        by_domain=rows(level(out, Level.DOMAIN)),
    )))
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(page_file.as_uri())
            assert page.title() == "Sluice delivery report"
            assert page.locator("svg.chart").count() == 3
            box = page.locator("#mix svg").bounding_box()
            assert box is not None and box["width"] > 300 and box["height"] > 20
            assert page.locator(".total-received").inner_text() == "5"
        finally:
            browser.close()
    assert errors == []


def _fallbacks(df) -> int:
    """How many tasks of df's object-hash aggregations fell back to sorting."""
    df._jdf.collectAsList()  # run df's own plan (kept in the JVM), whose metrics we read
    jvm_plan = df._jdf.queryExecution().executedPlan()

    def walk(plan):
        name = plan.nodeName()
        if name == "AdaptiveSparkPlan":
            yield from walk(plan.executedPlan())
            return
        if name.endswith("QueryStage"):
            yield from walk(plan.plan())
            return
        yield plan
        children = plan.children()
        for i in range(children.length()):
            yield from walk(children.apply(i))

    total = 0
    for node in walk(jvm_plan):
        if node.nodeName() == "ObjectHashAggregate":
            metric = node.metrics().get("numTasksFallBacked")
            if metric.isDefined():
                total += metric.get().value()
    return total


def test_percentiles_of_many_cells_stay_in_the_hash_aggregation(spark):
    # 10M events make some 160k detail cells per task; past Spark's
    # fall-back threshold every task sorted its sketches instead, at twice
    # the CPU.  One task here holds 120k cells.
    from pyspark.sql import functions as F

    cells = 120_000
    deliveries = spark.range(cells, numPartitions=1).select(
        F.lit(T0).alias("time"),
        F.lit("delivered").alias("event"),
        F.concat(F.lit("d"), F.col("id").cast("string"), F.lit(".example")).alias("domain"),
        F.lit("t1").alias("tenantid"),
        F.lit("j1").alias("jobid"),
        F.lit("192.0.2.1").alias("localip"),
        F.lit("mx.example").alias("remotemx"),
        (F.col("id") % 1000).cast("double").alias("queue_age_s"),
        F.lit(1).alias("attempt"),
    )
    rows = outcomes(deliveries)
    assert _fallbacks(rows) == 0
    assert level(rows, Level.TOTAL).collect()[0]["delivered"] == cells
