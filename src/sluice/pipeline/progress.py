"""Progress: Spark's work shown as a rich progress bar.

SUMMARY
    with SparkProgress(spark, enabled=True) as progress:
        progress.step("report: outcomes")
        ...Spark actions...
    with CountProgress(enabled=True) as counts:
        run_sendout(..., progress=counts.follow)     # rows injected, per second

DESCRIPTION
    Spark's own console progress bar is turned off (it writes over log
    lines and knows nothing of our steps); instead a thread asks Spark's
    status tracker, a few times a second, how many tasks the active stages
    have and how many are done, and draws one bar per step of the job.

STRATEGIES
    Polling, not listening: the status tracker is part of the public API on
    every master, while a listener would need JVM code.  The thread is a
    daemon and stops with the context; a failed poll (the session going
    away) ends it quietly.

SEE ALSO
    sluice.pipeline.jobs, rich.progress
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from pyspark.sql import SparkSession
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

__all__ = ["CountProgress", "SparkProgress"]


class SparkProgress:
    """A rich progress bar fed by Spark's status tracker."""

    def __init__(
        self,
        spark: SparkSession,
        enabled: bool = True,
        console: Console | None = None,
        interval_s: float = 0.25,
    ) -> None:
        self.spark = spark
        self.enabled = enabled
        self.interval_s = interval_s
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} tasks"),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
            transient=False,
        )
        self._task: TaskID | None = None
        self._done_before = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> SparkProgress:
        if self.enabled:
            self._progress.start()
            self._thread = threading.Thread(target=self._poll, name="spark-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self.enabled:
            self._finish()
            self._progress.stop()

    def step(self, description: str) -> None:
        """Start a new bar for the next part of the job."""
        if not self.enabled:
            return
        with self._lock:
            self._finish()
            self._task = self._progress.add_task(description, total=None)

    def _finish(self) -> None:
        if self._task is not None:
            task = next(t for t in self._progress.tasks if t.id == self._task)
            total = task.total if task.total is not None else 1
            self._progress.update(self._task, total=total, completed=total)
            self._task = None

    def _poll(self) -> None:
        tracker = self.spark.sparkContext.statusTracker()
        while not self._stop.wait(self.interval_s):
            try:
                stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
            except Exception:  # the session is going away
                return
            total = sum(s.numTasks for s in stages if s is not None)
            done = sum(s.numCompletedTasks for s in stages if s is not None)
            with self._lock:
                if self._task is not None and total > 0:
                    # The bar follows the stages running now; a step runs
                    # several stages one after another.
                    self._progress.update(self._task, total=total, completed=done)


class CountProgress:
    """A bar fed by Spark accumulators: rows injected of the total, and the rate.

    The job hands its accumulators to follow() when the injection starts;
    a thread reads them (Spark adds a task's counts when the task ends).
    """

    def __init__(self, enabled: bool = True, console: Console | None = None,
                 interval_s: float = 0.5) -> None:
        self.enabled = enabled
        self.interval_s = interval_s
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed:,.0f}/{task.total:,.0f} rows"),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
            transient=False,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> CountProgress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._progress.stop()

    def follow(self, counters: Mapping[str, Any], total: int) -> None:
        """Show the bar for ``total`` rows until stop(), read from ``counters`` on a thread.

        Does nothing when the bar is off or already following.
        """
        if not self.enabled or self._thread is not None:
            return
        task = self._progress.add_task("injecting", total=max(total, 1), detail="")
        self._progress.start()
        started = time.monotonic()

        def show() -> None:
            injected = int(counters["injected"].value)
            rate = injected / max(1e-3, time.monotonic() - started)
            self._progress.update(task, completed=injected, detail=(
                f"queued {int(counters['queued'].value):,} · refused "
                f"{int(counters['refused'].value):,} · {rate:,.0f}/s"))

        def poll() -> None:
            while not self._stop.wait(self.interval_s):
                show()
            show()

        self._thread = threading.Thread(target=poll, name="sendout-progress", daemon=True)
        self._thread.start()
