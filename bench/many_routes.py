"""The many-destinations mix: its domains, their next hops, and the private network they live in.

SUMMARY
    domain(k) -> "dK.test"                     k = 1 .. D
    nexthop(k) -> "127.10.X.Y"                 X = k >> 8, Y = k & 255
    sluice_transport(domains, port) -> {domain: "smtp:[127.10.X.Y]:port"}
    postfix_transport(domains, port) -> transport(5) source text
    enter_private_netns()                      unshare(CLONE_NEWNET), lo up
    check_private_netns()                      raises unless only lo is there

DESCRIPTION
    Every recipient domain dK.test is its own destination with its own next
    hop, a loopback address of its own (127.10.X.Y), so that an MTA keeps one
    queue (one slow-start window, one connection pool) per domain, as it
    would for 10,000 real remote domains.  Both MTAs get the same routing
    through their transport maps.

    One smtp-sink receives for all of those addresses by listening on
    0.0.0.0.  On the real host that would also listen on its non-loopback
    addresses, so it is done only inside a private network namespace whose
    one interface is lo: there, 0.0.0.0 means 127.0.0.0/8 and nothing else,
    and no packet can leave the namespace.  The benchmark process enters the
    namespace itself before it starts anything, so every MTA, sink and
    injector it starts is inside too (root is needed; we are root here).

STRATEGIES
    Addresses follow from the domain's number (no table to ship), and stay
    within 127.10.0.0/16, far from 127.0.0.1 where the MTAs listen.

SEE ALSO
    bench/e2e.py, bench/many_run.py, bench/many_postfix.py
"""

from __future__ import annotations

import ctypes
import os
import subprocess

CLONE_NEWNET = 0x40000000
MAX_DOMAINS = 65535  # 127.10.0.0/16 holds this many next hops (k = 1 .. 65535)


def domain(k: int) -> str:
    """The k-th recipient domain (k counts from 1)."""
    return f"d{k}.test"


def nexthop(k: int) -> str:
    """The k-th domain's own loopback address."""
    if not 1 <= k <= MAX_DOMAINS:
        raise ValueError(f"domain number {k} is outside 1..{MAX_DOMAINS}")
    return f"127.10.{k >> 8}.{k & 255}"


def sluice_transport(domains: int, port: int) -> dict[str, str]:
    """Sluice's delivery.transport: each domain to its own next hop."""
    return {domain(k): f"smtp:[{nexthop(k)}]:{port}" for k in range(1, domains + 1)}


def postfix_transport(domains: int, port: int) -> str:
    """The same routes as a Postfix transport(5) source file (for postmap)."""
    return "".join(f"{domain(k)} smtp:[{nexthop(k)}]:{port}\n" for k in range(1, domains + 1))


def interfaces() -> list[str]:
    """Network interfaces of the namespace this process is in."""
    # /proc/self/net follows the reader's namespace; /sys/class/net does not.
    with open("/proc/self/net/dev") as f:
        return [line.split(":", 1)[0].strip() for line in f.readlines()[2:]]


def check_private_netns() -> None:
    """Raise unless this process sees lo and nothing else (see the module doc)."""
    found = interfaces()
    if found != ["lo"]:
        raise RuntimeError(f"not in a private network namespace (interfaces: {found}); "
                           "refusing to listen on 0.0.0.0")


def enter_private_netns() -> None:
    """Move this process into a new network namespace with only lo, up.

    Call it before starting threads: a namespace belongs to the thread that
    made it, and the children started afterwards inherit it.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise RuntimeError(f"unshare(CLONE_NEWNET) failed: {os.strerror(err)} "
                           "(the many-destinations configs need root)")
    try:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    except FileNotFoundError:
        raise RuntimeError("`ip` is missing: apt-get install iproute2") from None
    check_private_netns()
