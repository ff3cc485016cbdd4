"""`sluice serve`, `sluice demo` and `sluice sink`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import time
from typing import Any

from sluice import _gc
from sluice.cli import CommandError, load
from sluice.sink import Behaviour, Sink, parse_behaviour


def register(sub: Any) -> None:
    """Add `sluice serve`, `sluice demo` and `sluice sink` to the command line."""
    p = sub.add_parser("serve", help="receive, queue and deliver mail (the MTA)")
    p.add_argument("--log-level", default=None,
                   choices=["debug", "info", "warning", "error"],
                   help="overrides logging.level of the configuration")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="show the whole flow locally: Sluice, a sink, 1000 messages")
    p.add_argument("--messages", type=int, default=1000)
    p.add_argument("--domains", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the demo's queue and logs")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS")
    p.add_argument("--nodes", type=int, default=1, metavar="N",
                   help="N > 1: a cluster of N nodes on a throwaway PostgreSQL and Redis")
    p.add_argument("--no-report", action="store_true",
                   help="skip the Spark report over the demo's accounting log")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("sink", help="run a programmable SMTP sink (a test next hop)")
    p.add_argument("--listen", default="127.0.0.1:2526", help="address:port (default %(default)s)")
    p.add_argument("--default", default="accept", metavar="BEHAVIOUR",
                   help="for domains not named (default %(default)s)")
    for kind in ("accept", "greylist", "reject", "tempfail"):
        p.add_argument(f"--{kind}", action="append", default=[], metavar="DOMAIN",
                       help=f"{kind} mail for DOMAIN (repeatable; *.example.com: subdomains)")
    p.add_argument("--slow", action="append", default=[], metavar="DOMAIN=SECONDS")
    p.add_argument("--throttle", action="append", default=[], metavar="DOMAIN=PER_MINUTE")
    p.add_argument("--hostname", default="sink.sluice.test")
    p.add_argument("--report", type=float, default=5.0, metavar="SECONDS",
                   help="print counts this often (0: never)")
    p.set_defaults(func=cmd_sink)


def cmd_serve(args: argparse.Namespace) -> int:
    """`sluice serve`: run the MTA until stopped; a failure to start exits 2."""
    from sluice.runtime.serve import PartFailed, ServeError, serve
    from sluice.scheduler import PolicyError
    from sluice.smtpd import ReceiverError

    cfg = load(args)
    _gc.for_serving()
    try:
        return serve(cfg, log_level=args.log_level)
    except PolicyError as exc:
        raise CommandError(f"policy error: {exc}", status=2) from None
    except (ServeError, ReceiverError) as exc:
        # It could not start (port taken, queue locked): like a bad file, exit 2.
        raise CommandError(str(exc), status=2) from None
    except PartFailed as exc:
        # Logged with its cause when it happened; everything else was stopped.
        raise CommandError(f"serve stopped: {exc}") from None


def cmd_demo(args: argparse.Namespace) -> int:
    """`sluice demo`: the whole flow on this machine, or a cluster with ``--nodes``."""
    from sluice.runtime.demo import run_demo

    if args.messages < 1 or args.domains < 5:
        raise CommandError("the demo needs at least 1 message and 5 domains", status=2)
    if args.nodes > 1:
        from sluice.runtime.cluster_demo import run_cluster_demo

        if args.nodes > 8:
            raise CommandError("--nodes: at most 8 on one machine", status=2)
        messages = args.messages if args.messages != 1000 else 600
        return run_cluster_demo(args.nodes, messages, args.seed, args.keep, args.timeout)
    return run_demo(args.messages, args.domains, args.seed, args.keep, args.timeout,
                    report=not args.no_report)


def _behaviours(args: argparse.Namespace) -> dict[str, Behaviour]:
    out: dict[str, Behaviour] = {}
    for kind in ("accept", "greylist", "reject", "tempfail"):
        for domain in getattr(args, kind):
            out[domain] = Behaviour(kind)
    for kind in ("slow", "throttle"):
        for item in getattr(args, kind):
            domain, sep, value = item.partition("=")
            if not sep:
                raise CommandError(f"--{kind} wants DOMAIN=VALUE, not {item!r}", status=2)
            out[domain] = parse_behaviour(f"{kind}={value}")
    return out


def cmd_sink(args: argparse.Namespace) -> int:
    """`sluice sink`: run an SMTP sink with per-domain behaviours until interrupted."""
    host, _, port = args.listen.rpartition(":")
    try:
        sink = Sink(_behaviours(args), default=parse_behaviour(args.default),
                    hostname=args.hostname)
        port_n = int(port)
    except ValueError as exc:
        raise CommandError(str(exc), status=2) from None

    async def main() -> None:
        bound = await sink.start(host.strip("[]") or "127.0.0.1", port_n)
        print(f"sink listening on {host}:{bound}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        last = time.monotonic()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            if args.report and time.monotonic() - last >= args.report:
                last = time.monotonic()
                s = sink.snapshot()
                print(f"delivered={s.total_delivered} transactions={s.transactions} "
                      f"connections={s.connections} now={s.current_connections} "
                      f"peak={s.peak_connections}", flush=True)
        await sink.stop()
        s = sink.snapshot()
        print(f"stopped: delivered={s.total_delivered} by domain: {dict(s.delivered)}")

    try:
        asyncio.run(main())
    except OSError as exc:
        raise CommandError(f"cannot listen on {args.listen}: {exc.strerror or exc}") from None
    return 0
