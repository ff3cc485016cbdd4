#!/usr/bin/env python3
"""The long run of the SMTP fuzzer: many seeded sessions against one `sluice serve`.

    .venv/bin/python bench/smtp_fuzz.py [--sessions 100000] [--seed 22] [--first 0]
                                        [--threads 4] [--chunk 10000] [--minutes M]

Not a speed figure: a soak.  It starts `sluice serve` (the suite's test
settings: one receiving process, 64 KB size limit, 4 KB spill threshold,
delivery to an in-process sink) in a temp directory and plays sessions from
tests/integration/smtp_fuzz.py, the generator the suite's test uses, in
chunks.  After every chunk it checks that the server is still running and
prints a progress line with the machine's load.  At the end (all sessions,
or --minutes spent, or the server gone) it sends one normal message, waits
until the queue has drained (no recipient left), stops the server and scans
its output for tracebacks and "session error" lines.

A session makes about ten inputs (a command line, a pipelined group, a
message's content or a burst of junk are one input each), so the default
100,000 sessions are about a million inputs.

Session i of a seed is always the same, so a finding is replayed with
``--seed S --first i --sessions 1``.

Last line:
    fuzz sessions=N inputs=N accepted=N silent=N malformed=N refused=N
         tracebacks=N after_ok=yes|no exit=N elapsed_s=.. load=..
and the exit status is 1 when anything but a clean run was seen.
"""

from __future__ import annotations

import argparse
import smtplib
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.integration.serving import start_serve, wait_until  # noqa: E402
from tests.integration.smtp_fuzz import Tally, fuzz  # noqa: E402
from tests.integration.test_smtp_fuzz import FUZZ_SMTPD  # noqa: E402

from sluice.sink import Sink  # noqa: E402


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=22)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=10_000)
    ap.add_argument("--minutes", type=float, default=0.0, help="stop after this long (0: never)")
    args = ap.parse_args()

    print(f"start load={loadavg()}", flush=True)
    total = Tally()
    sink = Sink(keep=False)
    sport = sink.start_in_thread()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sluice-fuzz-") as tmp:
        srv = start_serve(Path(tmp), smtpd=FUZZ_SMTPD,
                          delivery={"transport": {"*": f"smtp:[127.0.0.1]:{sport}"}})
        alive = True
        try:
            done = 0
            while done < args.sessions:
                n = min(args.chunk, args.sessions - done)
                t = fuzz(srv.port, args.seed, n, threads=args.threads, first=args.first + done)
                done += t.sessions
                o, out = total.outcome, t.outcome
                total.sessions += t.sessions
                o.codes.update(out.codes)
                o.malformed += out.malformed[:10]
                o.silent += out.silent
                o.refused += out.refused
                o.accepted += out.accepted
                o.inputs += out.inputs
                alive = srv.proc.poll() is None
                elapsed = time.monotonic() - started
                print(f"chunk first={args.first + done - n} sessions={done} inputs={o.inputs} "
                      f"accepted={o.accepted} silent={o.silent} malformed={len(o.malformed)} "
                      f"refused={o.refused} alive={alive} elapsed_s={elapsed:.0f} "
                      f"load={loadavg()}", flush=True)
                if not alive or (args.minutes and elapsed > args.minutes * 60):
                    break
            after_ok = False
            if alive:
                with smtplib.SMTP("127.0.0.1", srv.port, local_hostname="after.test",
                                  timeout=30) as client:
                    client.sendmail("a@sender.example", ["after@dest.example"],
                                    b"Subject: after the fuzz\r\n\r\nhello\r\n")
                after_ok = wait_until(lambda: srv.recipients_left() == 0, 120)
        finally:
            code = srv.stop()
            sink.stop_thread()
    log = "\n".join(srv.output)
    tracebacks = log.count("Traceback") + log.count("session error")
    if tracebacks:
        at = max(log.find("Traceback"), log.find("session error"))
        print(log[max(0, at - 500):at + 3000], file=sys.stderr)
    for line in total.outcome.malformed[:10]:
        print(f"malformed reply: {line!r}", file=sys.stderr)
    o = total.outcome
    print(f"codes {dict(sorted(o.codes.items()))}")
    print(f"fuzz sessions={total.sessions} inputs={o.inputs} accepted={o.accepted} "
          f"silent={o.silent} malformed={len(o.malformed)} refused={o.refused} "
          f"tracebacks={tracebacks} after_ok={'yes' if after_ok else 'no'} exit={code} "
          f"elapsed_s={time.monotonic() - started:.0f} load={loadavg()}")
    clean = (alive and after_ok and code == 0 and not tracebacks and not o.silent
             and not o.malformed and not o.refused)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
