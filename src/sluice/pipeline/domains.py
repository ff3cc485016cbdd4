"""The sendout's domain check: does a domain take mail at all?  Asked once, cached.

SUMMARY
    verdicts(spark, domains, dns=DnsSettings(...), cache=None, ttl_s=86400, now=...)
        -> DataFrame (domain, ok, reason, checked_at)
    verdict_of(router, domain) -> (ok, reason)      one domain (async)

DESCRIPTION
    A campaign list has many addresses at domains that cannot receive
    mail: typos (gmial.com), domains that lapsed, domains that publish a
    null MX (RFC 7505).  Sending to them costs reputation.  Each distinct
    domain is routed the way delivery routes it -- sluice.delivery.router,
    the same MX, implicit-MX and null-MX rules -- and gets a verdict:

    ok        MX hosts with addresses, or an address (implicit MX);
    not ok    NXDOMAIN, null MX, or no MX and no address (a permanent
              failure); the reason is the router's text;
    ok too    a temporary failure (SERVFAIL, timeout): the domain may be
              fine, and delivery will try again anyway.

    ``dns`` names the servers (a loopback server in tests; none means the
    system's resolver).  Lookups run on the executors, many at a time per
    task, over the distinct domains only.

STRATEGIES
    Cache: verdicts are appended to a Parquet table (``cache``) with the
    time they were made; a run reads the newest verdict per domain,
    checks only domains without one younger than ``ttl_s``, and appends
    what it learnt -- append only, so a run never overwrites the table it
    reads, and two runs at once lose nothing.

SEE ALSO
    sluice.delivery.router, sluice.pipeline.sendout.check_domains
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from sluice.pipeline import hfs

if TYPE_CHECKING:
    import pandas as pd

    from sluice.delivery.router import Router

__all__ = ["VERDICT_SCHEMA", "DnsSettings", "verdict_of", "verdicts"]

VERDICT_SCHEMA = "domain string, ok boolean, reason string, checked_at timestamp"

#: Lookups in flight at once in one task.
CONCURRENCY = 50

#: Domains per task.
DOMAINS_PER_TASK = 2000


@dataclass(frozen=True, slots=True)
class DnsSettings:
    """Which DNS servers to ask (none: the system's), and how patiently."""

    nameservers: tuple[str, ...] = ()
    port: int = 53
    timeout_s: float = 5.0


def _router(dns: DnsSettings) -> Router:
    from sluice.config import DeliveryConfig, ResolverConfig
    from sluice.delivery.router import Router

    resolver = ResolverConfig(nameservers=dns.nameservers, port=dns.port,
                              timeout=dns.timeout_s)
    return Router(DeliveryConfig(resolver=resolver))


async def verdict_of(router: Router, domain: str) -> tuple[bool, str | None]:
    """(ok, reason): ok unless routing the domain fails permanently."""
    from sluice.model import PermFail

    routed = await router.route(domain)
    if isinstance(routed, PermFail):
        return False, f"{routed.reply.code} {routed.reply.enhanced} {routed.reply.text}"
    return True, None


def _lookup_partition(dns: DnsSettings) -> Any:
    def run(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        import pandas as pd

        names = [d for batch in batches for d in batch["domain"].tolist()]
        if not names:
            return

        async def all_of() -> list[tuple[bool, str | None]]:
            router = _router(dns)
            limit = asyncio.Semaphore(CONCURRENCY)

            async def one(name: str) -> tuple[bool, str | None]:
                async with limit:
                    return await verdict_of(router, name)

            return await asyncio.gather(*(one(n) for n in names))

        found = asyncio.run(all_of())
        now = pd.Timestamp(datetime.now(UTC))
        yield pd.DataFrame({"domain": names, "ok": [ok for ok, _ in found],
                            "reason": [why for _, why in found],
                            "checked_at": [now] * len(names)})

    return run


def verdicts(spark: SparkSession, domains: DataFrame, *, dns: DnsSettings,
             cache: str | None = None, ttl_s: float = 86400.0,
             now: datetime | None = None) -> DataFrame:
    """A verdict for every distinct ``domain`` of ``domains`` (checked or cached)."""
    wanted = domains.select("domain").where(F.col("domain").isNotNull()).distinct()
    at = now or datetime.now(UTC)
    known = None
    if cache is not None and hfs.exists(spark, cache):
        newest = Window.partitionBy("domain").orderBy(F.col("checked_at").desc())
        fresh_after = F.lit(datetime.fromtimestamp(at.timestamp() - ttl_s, UTC))
        known = (spark.read.schema(VERDICT_SCHEMA).parquet(cache)
                 .withColumn("_n", F.row_number().over(newest)).where(F.col("_n") == 1)
                 .drop("_n").where(F.col("checked_at") >= fresh_after)
                 .join(wanted, "domain", "left_semi"))
        wanted = wanted.join(known, "domain", "left_anti")
    todo = wanted.localCheckpoint()  # counted and partitioned once
    count = todo.count()
    checked = spark.createDataFrame([], VERDICT_SCHEMA)
    if count:
        parts = max(1, -(-count // DOMAINS_PER_TASK))
        checked = (todo.repartition(parts)
                   .mapInPandas(_lookup_partition(dns), VERDICT_SCHEMA)
                   .localCheckpoint())
        if cache is not None:
            checked.write.mode("append").parquet(cache)
    return checked if known is None else checked.unionByName(known)
