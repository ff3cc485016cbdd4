"""The scheduler's settings, with the specification's names and defaults.

SUMMARY
    Settings(maxmemoryqueue=..., ...); Settings.from_config(config)

DESCRIPTION
    The knobs of the active queue (maxmemoryqueue, quota_deferred, the
    refill), of the queue manager's total concurrency (max_deliveries), of
    Postfix's slow start and destination status cache, and the tenants'
    shares (weights and minimum shares, sluice.scheduler.tenants).  The scheduler
    imports no configuration: from_config() reads a sluice.config.Config
    duck-typed, so that the core stays free of files and schemas.

SEE ALSO
    docs/configuration.md (scheduler and queue sections), seeds/003
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from sluice.scheduler.tenants import Shares

__all__ = ["Settings"]


class _SchedulerSection(Protocol):
    @property
    def initial_destination_concurrency(self) -> int: ...
    @property
    def default_destination_concurrency_limit(self) -> int: ...
    @property
    def destination_concurrency_failed_cohort_limit(self) -> int: ...
    @property
    def dead_destination_ttl(self) -> float: ...
    @property
    def destination_cache_size(self) -> int: ...
    @property
    def refill_interval(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Settings:
    """The scheduler's knobs, with the specification's names and defaults."""

    maxmemoryqueue: int = 10000
    quota_deferred: int = 10
    max_deliveries: int = 200
    initial_destination_concurrency: int = 2
    default_destination_concurrency_limit: int = 20
    destination_concurrency_failed_cohort_limit: int = 1
    dead_destination_ttl_s: float = 300.0
    destination_cache_size: int = 10000
    refill_interval_s: float = 1.0
    refill_batch: int = 1000
    shares: Shares = field(default_factory=Shares)

    def __post_init__(self) -> None:
        if self.maxmemoryqueue < 1 or self.max_deliveries < 1 or self.refill_batch < 1:
            raise ValueError("maxmemoryqueue, max_deliveries and refill_batch must be >= 1")
        if self.initial_destination_concurrency < 1:
            raise ValueError("initial_destination_concurrency must be >= 1")
        if not 0 <= self.quota_deferred <= 100:
            raise ValueError("quota_deferred is a percentage")

    @classmethod
    def from_config(cls, config: Any) -> Settings:
        """From a sluice.config.Config (duck-typed: this module imports no config)."""
        sched: _SchedulerSection = config.scheduler
        return cls(
            maxmemoryqueue=config.queue.maxmemoryqueue,
            quota_deferred=config.queue.quota_deferred,
            max_deliveries=getattr(sched, "max_deliveries", 0) or config.delivery.max_connections,
            initial_destination_concurrency=sched.initial_destination_concurrency,
            default_destination_concurrency_limit=sched.default_destination_concurrency_limit,
            destination_concurrency_failed_cohort_limit=(
                sched.destination_concurrency_failed_cohort_limit),
            dead_destination_ttl_s=sched.dead_destination_ttl,
            destination_cache_size=sched.destination_cache_size,
            refill_interval_s=sched.refill_interval,
            refill_batch=getattr(sched, "refill_batch", 1000),
            shares=_shares(getattr(sched, "tenants", None)),
        )


def _shares(tenants: Any) -> Shares:
    """The config's ``scheduler.tenants`` section (duck-typed), or equal shares."""
    if tenants is None:
        return Shares()
    return Shares(dict(tenants.weights), tenants.default_weight, dict(tenants.min_shares),
                  fair=tenants.fair)
