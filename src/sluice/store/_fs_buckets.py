"""The filesystem flavour's incoming buckets: incoming/ split by priority, arrival and tenant.

SUMMARY
    bucket_of(spid, priority, tenant) names the incoming/ sub-directory of
    a control file; bucket_key, bucket_tenant, sorted_buckets read names
    back; bucket_is_current says whether mail may still arrive in one.

DESCRIPTION
    ``incoming/p<priority>-<the SPID's first 8 hex digits>[-<tenant>]``:
    the SPID starts with its milliseconds, so its first 8 digits change
    every 4.1 s and order buckets by arrival.  Buckets sort by priority
    (1 first), then by those digits -- the order a refill claims in -- so
    a refill lists the first buckets and stops once it has enough.  The
    tenant, URL-quoted, lets a refill that shares out by tenant take each
    tenant's first buckets without reading a control file; a tenant too
    long for a name is shortened with a hash and read from the files.

STRATEGIES
    An emptied bucket is removed once no new mail can arrive in it (older
    than the current one and the one before), so a queue that keeps up
    does not pay a mkdir and a directory fsync per batch.

SEE ALSO
    sluice.store._fs_layout (where files go), sluice.store._fs_batch
    (first_incoming, the refill's walk)
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from urllib.parse import quote, unquote

from sluice.spool import spid_head

#: SPID digits a bucket is named by: 8 hex digits of milliseconds are 4.1 s.
BUCKET_DIGITS = 8
TENANT_MAX = 80
_HEX = frozenset("0123456789ABCDEF")
_HEAD = 3 + BUCKET_DIGITS  # "p0-" and the digits


def _enc_tenant(tenant: str) -> str:
    enc = quote(tenant, safe="-._")
    if len(enc) <= TENANT_MAX:
        return enc
    digest = hashlib.sha256(tenant.encode()).hexdigest()[:16]
    return f"{enc[:TENANT_MAX - 17]}~{digest}"


def bucket_of(spid: str, priority: int, tenant: str = "") -> str:
    """The incoming/ bucket of a control file."""
    head = f"p{priority}-{spid[:BUCKET_DIGITS]}"
    return f"{head}-{_enc_tenant(tenant)}" if tenant else head


def bucket_key(bucket: str) -> tuple[int, str] | None:
    """A bucket's place in claim order (high priority first, then oldest), or None."""
    if (len(bucket) < _HEAD or bucket[0] != "p" or bucket[1] not in "01"
            or bucket[2] != "-" or not _HEX.issuperset(bucket[3:_HEAD])
            or (len(bucket) > _HEAD and (bucket[_HEAD] != "-" or len(bucket) == _HEAD + 1))):
        return None
    return -int(bucket[1]), bucket[3:_HEAD]


def bucket_tenant(bucket: str) -> str | None:
    """The tenant a bucket holds mail of ("" for none), or None if its name had to be cut."""
    rest = bucket[_HEAD + 1:]
    if "~" in rest:
        return None
    return unquote(rest)


def bucket_is_current(bucket: str, now_ms: int | None = None) -> bool:
    """Whether new mail may still arrive in ``bucket`` (this 4.1 s or the one before)."""
    ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    now_prefix = int(spid_head(ms)[:BUCKET_DIGITS], 16)
    return int(bucket[3:_HEAD], 16) >= now_prefix - 1


def sorted_buckets(names: Iterable[str]) -> list[str]:
    """The incoming/ buckets among ``names``, in claim order (ties by tenant)."""
    keyed = [(key, name) for name in names if (key := bucket_key(name)) is not None]
    return [name for _, name in sorted(keyed)]
