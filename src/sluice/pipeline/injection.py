"""Injection from Spark tasks: each partition posts its recipients to the HTTP injection API.

SUMMARY
    target = InjectTarget(url, token, sender, job, tenant, template, ...)
    outcomes = work.mapInPandas(inject_partition(target, counters), OUTCOME_SCHEMA)
    idempotency_key(job, address) -> str

DESCRIPTION
    Runs on the executors.  A partition's rows (sorted by domain) are cut
    into batches of ``batch_size`` recipients, each batch one templated
    message of POST /api/v1/inject with the recipients' substitutions and
    idempotency keys; ``concurrency`` batches are in flight per task.
    Each recipient ends as one outcome row: queued (with its queue id;
    ``duplicate`` when the API answered from its idempotency index) or
    refused (with the SMTP code and reason).

STRATEGIES
    Never twice.  The key of a recipient is a hash of the job id and the
    address, so a Spark task that is retried, a speculative copy of it, or
    a rerun of the whole job (within the API's idempotency window) is
    answered with the first queue ids and queues nothing again.  Hence
    every retry below is safe.

    Back-pressure.  429 and 503 are waited out for their Retry-After (at
    most ``max_wait_s`` per batch in all) and the batch is sent again; a
    recipient refused with 4xx is sent again after a pause, up to
    ``attempts`` times; a lost connection or a 5xx of the server is
    retried with backoff.  A 4xx of the request itself (a bad token, a
    body the API refuses) fails the task with the API's words: every
    batch would fail the same way.

    Plain http.client, one keep-alive connection per thread: executors
    need nothing beyond the standard library for this part.

SEE ALSO
    sluice.api.inject (the API), sluice.pipeline.sendout_job
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["OUTCOME_SCHEMA", "InjectTarget", "InjectionError", "idempotency_key",
           "inject_partition"]

#: One row per input row, whatever became of it.
OUTCOME_SCHEMA = (
    "row long, input string, address string, domain string, status string, "
    "queue_id string, code int, enhanced string, reason string, duplicate boolean, "
    "attempts int, at timestamp"
)

#: Pause before a recipient refused with 4xx is sent again (doubles each time).
RETRY_PAUSE_S = 1.0


class InjectionError(RuntimeError):
    """The API refuses the requests themselves (token, body): the task fails."""


def idempotency_key(job: str, address: str) -> str:
    """The key of one recipient of one job: the same on every retry and rerun."""
    digest = hashlib.sha256(f"{job}\n{address.lower()}".encode()).hexdigest()
    return f"sendout:{digest[:48]}"


@dataclass(frozen=True, slots=True)
class InjectTarget:
    """Where and how a partition injects: the API, its token, the message template and limits."""
    url: str  # http://127.0.0.1:8025
    token: str
    sender: str
    job: str
    tenant: str
    template: Mapping[str, Any]  # the API's template content (from, subject, ...)
    priority: int = 0
    batch_size: int = 100
    concurrency: int = 4
    attempts: int = 5
    max_wait_s: float = 600.0
    timeout_s: float = 120.0
    headers: Mapping[str, str] = field(default_factory=dict)


class _Http:
    """A keep-alive connection per thread to the API."""

    def __init__(self, target: InjectTarget) -> None:
        parts = urllib.parse.urlsplit(target.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InjectionError(f"{target.url}: not an http:// or https:// URL")
        self.parts = parts
        self.target = target
        self.local = threading.local()
        self._made: list[http.client.HTTPConnection] = []  # every thread's, to close

    def _conn(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self.local, "conn", None)
        if conn is None:
            cls = (http.client.HTTPSConnection if self.parts.scheme == "https"
                   else http.client.HTTPConnection)
            conn = cls(self.parts.hostname or "", self.parts.port,
                       timeout=self.target.timeout_s)
            self.local.conn = conn
            self._made.append(conn)
        return conn

    def close(self) -> None:
        """Close every thread's connection (when the partition is done)."""
        for conn in self._made:
            conn.close()
        self._made.clear()

    def post(self, body: bytes) -> tuple[int, Mapping[str, str], Any]:
        conn = self._conn()
        path = self.parts.path.rstrip("/") + "/api/v1/inject"
        try:
            conn.request("POST", path, body=body, headers={
                "Authorization": f"Bearer {self.target.token}",
                "Content-Type": "application/json", **self.target.headers})
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            self.local.conn = None
            raise
        try:
            parsed = json.loads(data) if data else None
        except ValueError:
            parsed = None
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed


def _outcome(row: Mapping[str, Any], status: str, attempts: int, *, queue_id: str | None = None,
             code: int | None = None, enhanced: str | None = None, reason: str | None = None,
             duplicate: bool = False) -> dict[str, Any]:
    return {"row": row["row"], "input": row["input"], "address": row["address"],
            "domain": row["domain"], "status": status, "queue_id": queue_id, "code": code,
            "enhanced": enhanced, "reason": reason, "duplicate": duplicate,
            "attempts": attempts}


def _send_batch(api: _Http, target: InjectTarget, rows: Sequence[Mapping[str, Any]],
                sleep: Callable[[float], None] = time.sleep) -> list[dict[str, Any]]:
    """Every recipient of ``rows`` to an outcome (see Strategies)."""
    pending = list(rows)
    tries: dict[int, int] = {}
    out: list[dict[str, Any]] = []
    waited = 0.0
    failures = 0
    pause = RETRY_PAUSE_S

    def refused(enhanced: str, reason: str) -> list[dict[str, Any]]:
        """Every recipient still pending, refused with a temporary 451."""
        return out + [_outcome(r, "refused", tries.get(id(r), 0) + 1, code=451,
                               enhanced=enhanced, reason=reason) for r in pending]

    while pending:
        recipients = []
        for r in pending:
            subs = {k: v for k, v in (r.get("substitutions") or {}).items() if v is not None}
            recipients.append({"email": r["address"], "substitutions": subs,
                               "idempotency_key": idempotency_key(target.job, r["address"])})
        body = json.dumps({"messages": [{
            "envelope_sender": target.sender, "content": dict(target.template),
            "recipients": recipients, "tenant": target.tenant, "job": target.job,
            "priority": target.priority}]}).encode()
        try:
            status, headers, answer = api.post(body)
        except (OSError, http.client.HTTPException) as exc:
            failures += 1
            if failures >= target.attempts:
                return refused("4.4.1", f"injection API unreachable: {exc}")
            sleep(min(30.0, pause))
            pause *= 2
            continue
        if status in (429, 503):
            wait = _retry_after(headers.get("retry-after"))
            if waited + wait > target.max_wait_s:
                reason = (answer or {}).get("detail") or f"HTTP {status}"
                return refused("4.3.2", f"injection API busy: {reason}")
            sleep(wait)
            waited += wait
            continue
        if status >= 500:
            failures += 1
            if failures >= target.attempts:
                return refused("4.3.0", f"injection API failed: HTTP {status}")
            sleep(min(30.0, pause))
            pause *= 2
            continue
        if status != 200 or not isinstance(answer, dict):
            said = answer if isinstance(answer, dict) else {}
            raise InjectionError(f"the injection API refused the request: HTTP {status} "
                                 f"{said.get('error', '')} {said.get('detail') or ''}".strip())
        results = answer["messages"][0]["recipients"]
        again = []
        for r, res in zip(pending, results, strict=True):
            tries[id(r)] = tries.get(id(r), 0) + 1
            if res["status"] == "queued":
                out.append(_outcome(r, "queued", tries[id(r)], queue_id=res.get("queue_id"),
                                    duplicate=bool(res.get("duplicate"))))
            elif 400 <= (res.get("code") or 500) < 500 and tries[id(r)] < target.attempts:
                again.append(r)
            else:
                out.append(_outcome(r, "refused", tries[id(r)], code=res.get("code"),
                                    enhanced=res.get("enhanced"), reason=res.get("reason")))
        pending = again
        if pending:
            sleep(min(30.0, pause))
            pause *= 2
    return out


def _retry_after(value: str | None) -> float:
    try:
        return max(0.5, min(300.0, float(value))) if value else 5.0
    except ValueError:
        return 5.0


def inject_partition(target: InjectTarget, counters: Mapping[str, Any] | None = None
                     ) -> Callable[[Iterator[pd.DataFrame]], Iterator[pd.DataFrame]]:
    """The mapInPandas function: work rows in, OUTCOME_SCHEMA rows out.

    ``counters`` (Spark accumulators ``injected``, ``queued``, ``refused``)
    feed the driver's progress.
    """

    def run(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        import pandas as pd

        api = _Http(target)
        columns = ["row", "input", "address", "domain", "substitutions"]
        with contextlib.closing(api), \
                concurrent.futures.ThreadPoolExecutor(max_workers=target.concurrency) as pool:
            for frame in batches:
                rows = frame[columns].to_dict("records")
                for r in rows:
                    subs = r["substitutions"]
                    r["substitutions"] = dict(subs) if subs is not None else {}
                chunks = [rows[i:i + target.batch_size]
                          for i in range(0, len(rows), target.batch_size)]
                done: list[dict[str, Any]] = []
                for result in pool.map(lambda chunk: _send_batch(api, target, chunk), chunks):
                    done += result
                    if counters is not None:
                        counters["injected"].add(len(result))
                        counters["queued"].add(sum(1 for o in result if o["status"] == "queued"))
                        counters["refused"].add(sum(1 for o in result
                                                    if o["status"] == "refused"))
                if not done:
                    continue
                out = pd.DataFrame(done)
                out["at"] = pd.Timestamp.now(tz="UTC")
                out["code"] = out["code"].astype("Int32")
                out["attempts"] = out["attempts"].astype("int32")
                yield out[[c.split()[0] for c in OUTCOME_SCHEMA.split(", ")]]

    return run
