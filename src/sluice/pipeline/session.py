"""The SparkSession the pipeline runs in: embedded by default, any master by flag.

SUMMARY
    build_session(master="local[*]", app_name=..., conf=None) -> SparkSession
    pipeline_session(master, ...)   context manager; stops what it started

DESCRIPTION
    Spark runs embedded (``local[*]``) unless the operator names another
    master (``spark://``, ``yarn``, ``k8s://``); the jobs are the same code.
    For local masters the session is made quiet and loopback-only, the
    settings measured in the project's field notes: no web UI, no console
    progress bar of Spark's own (the CLI draws its own), UTC session time
    zone, shuffle partitions sized to the cores, and a log4j2 configuration
    that keeps Spark's log at ERROR.  On every master the cached events are
    kept uncompressed (cheaper to build; hardly larger), the report's
    percentile sketches stay in hash aggregation up to a split's worth of
    cells (SKETCH_KEYS_PER_TASK), and tables by day are written by a few
    open writers per task rather than after sorting every row by its day
    (DAY_WRITERS_PER_TASK).  Python workers
    run the interpreter the CLI runs in (python_workers), so that they find
    Sluice without an activated virtual environment.

STRATEGIES
    Reuse.  When a session is already active in this process (a test suite,
    a notebook), it is used as it is and not stopped afterwards: changing a
    running session's settings would surprise its owner.

    Quiet start.  log4j2 reads its configuration when the JVM starts, so the
    properties file is written before the session exists, to a private
    file in the temporary directory, and handed to the driver JVM by
    ``spark.driver.extraJavaOptions``.  An operator's own SPARK_CONF_DIR
    wins: then nothing is written.

LIMITATIONS
    Driver memory and JVM options take effect only for a new JVM; on an
    already running session they are ignored.

SEE ALSO
    sluice.pipeline.progress, docs/analytics.md
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from pyspark.sql import SparkSession

__all__ = ["DAY_WRITERS_PER_TASK", "LOG4J2_PROPERTIES", "SKETCH_KEYS_PER_TASK",
           "build_session", "is_local", "pipeline_session", "python_workers"]

#: Spark's log kept at ERROR; PythonGatewayServer is noisy at INFO on start.
LOG4J2_PROPERTIES = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
logger.pgs.name = org.apache.spark.api.python.PythonGatewayServer
logger.pgs.level = error
logger.hadoop.name = org.apache.hadoop
logger.hadoop.level = error
"""


#: Keys one task keeps in an object-hash aggregation (the report's
#: percentile sketches) before Spark falls back to sorting them.  Spark's
#: default is 128; 100,000 sufficed for 1M events (30k detail cells per
#: task) but not for 10M (160k per task: every task fell back, and the
#: sketches' map side cost 74 CPU-seconds instead of 34).  A task reads at
#: most one split of the input (128 MB of Parquet, some 2M events, of which
#: 0.8M deliveries), so it never holds more than that many sketches, a few
#: hundred bytes each for the few values of a detail cell.
SKETCH_KEYS_PER_TASK = 1_000_000


#: Output files one task keeps open when it writes a table by day.
DAY_WRITERS_PER_TASK = 4


def is_local(master: str) -> bool:
    """Whether the Spark master runs in this process (``local``, ``local[N]``, ...)."""
    return master == "local" or master.startswith("local[") or master.startswith("local-")


def _local_cores(master: str) -> int:
    inner = master[len("local["):-1] if master.startswith("local[") else "1"
    inner = inner.split(",")[0]
    if inner == "*":
        return os.cpu_count() or 1
    try:
        return max(1, int(inner))
    except ValueError:
        return os.cpu_count() or 1


def _log4j2_file() -> Path:
    # One file per user, rewritten only when it differs: no litter per run.
    path = Path(tempfile.gettempdir()) / f"sluice-log4j2-{os.getuid()}.properties"
    try:
        if path.read_text("utf-8") == LOG4J2_PROPERTIES:
            return path
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".sluice-log4j2-")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(LOG4J2_PROPERTIES)
    os.replace(tmp, path)
    return path


def build_session(
    master: str = "local[*]",
    app_name: str = "sluice-analytics",
    conf: Mapping[str, str] | None = None,
    driver_memory: str | None = None,
) -> SparkSession:
    """A session on ``master``; the active one if this process has one."""
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    builder = SparkSession.builder.master(master).appName(app_name)
    settings: dict[str, str] = {
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
        # The report's detail level has hundreds of thousands of cells, each
        # with a percentile sketch; past this many keys per task Spark falls
        # back to sort-based aggregation (see SKETCH_KEYS_PER_TASK).
        "spark.sql.objectHashAggregate.sortBased.fallbackThreshold": str(SKETCH_KEYS_PER_TASK),
        # The jobs cache the events they read (sluice.pipeline.jobs).
        # Compressing that cache costs as much CPU again as building it and
        # saves some 15 % of its size: most columns are ids, addresses and
        # replies that compress little in batches of 10,000 rows.
        "spark.sql.inMemoryColumnarStorage.compressed": "false",
        # Tables partitioned by day (sluice.pipeline.load) are written by a
        # few open writers per task, one per day, instead of sorting every
        # row by its day first; the sort is what Spark plans by default and
        # falls back to past this many days in one task.  At 10M events
        # building and sorting the hourly detail cost 15-16 CPU-seconds
        # with the sort, 8.7 without.
        "spark.sql.optimizer.plannedWrite.enabled": "false",
        "spark.sql.maxConcurrentOutputFileWriters": str(DAY_WRITERS_PER_TASK),
    }
    if is_local(master):
        # Loopback only: otherwise Spark binds the first non-loopback
        # address and warns about it.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        cores = _local_cores(master)
        settings.update({
            "spark.ui.enabled": "false",
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.sql.shuffle.partitions": str(max(2, 2 * cores)),
            "spark.default.parallelism": str(max(2, 2 * cores)),
            "spark.driver.memory": driver_memory or "2g",
        })
    elif driver_memory:
        settings["spark.driver.memory"] = driver_memory
    if not os.environ.get("SPARK_CONF_DIR"):
        path = _log4j2_file()
        settings["spark.driver.extraJavaOptions"] = f"-Dlog4j2.configurationFile=file:{path}"
    settings.update(python_workers(conf or {}))
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


def python_workers(conf: Mapping[str, str]) -> dict[str, str]:
    """The interpreter Spark's Python workers run: this one, unless the operator chose.

    Spark starts them with ``python3`` from the PATH by default, which
    outside an activated virtual environment has no Sluice (the sendout's
    injection runs in them: "No module named 'sluice'").  The choice is
    PYSPARK_PYTHON, else ``--conf spark.pyspark.python=...``, else this
    interpreter; it goes into the environment too, which is where the
    workers of a local master take it from (the setting serves the
    cluster managers).
    """
    chosen = (os.environ.get("PYSPARK_PYTHON") or conf.get("spark.pyspark.python")
              or sys.executable)
    os.environ["PYSPARK_PYTHON"] = chosen
    return {} if "spark.pyspark.python" in conf else {"spark.pyspark.python": chosen}


@contextmanager
def pipeline_session(
    master: str = "local[*]",
    app_name: str = "sluice-analytics",
    conf: Mapping[str, str] | None = None,
    driver_memory: str | None = None,
) -> Iterator[SparkSession]:
    """build_session(), stopped at the end only if this call started it."""
    existed = SparkSession.getActiveSession() is not None
    session = build_session(master, app_name, conf, driver_memory)
    try:
        yield session
    finally:
        if not existed:
            session.stop()
