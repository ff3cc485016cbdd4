"""Thousands of fuzzed SMTP sessions against `sluice serve`: it stays up and logs no traceback.

The sessions come from tests/integration/smtp_fuzz.py (seeded, so a failure
replays).  Afterwards the same server must answer a normal message with 250
and deliver it, stop cleanly, and its output must hold no traceback and no
"session error" (the line the receiver writes for a failure of its own, as
opposed to one the client caused).  bench/smtp_fuzz.py is the long run.
"""

from __future__ import annotations

import smtplib
from pathlib import Path

import pytest

from sluice.sink import Sink
from tests.integration.serving import start_serve, wait_until
from tests.integration.smtp_fuzz import fuzz

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEED = 22
SESSIONS = 3000

#: A small size limit and spill threshold, so oversized and spilled content is reached cheaply.
FUZZ_SMTPD = {"processes": 1, "max_message_size": 65536, "spill_size": 4096,
              "max_recipients": 5, "timeout": "5s"}


def test_fuzzed_sessions_leave_the_server_up_and_quiet(tmp_path: Path) -> None:
    sink = Sink(keep=True)
    sport = sink.start_in_thread()
    try:
        srv = start_serve(tmp_path, smtpd=FUZZ_SMTPD,
                          delivery={"transport": {"*": f"smtp:[127.0.0.1]:{sport}"}})
        try:
            tally = fuzz(srv.port, SEED, SESSIONS, threads=4)
            out = tally.outcome
            print(f"\nfuzz: {tally.sessions} sessions ({out.inputs} inputs) in "
                  f"{tally.elapsed_s:.1f} s; "
                  f"{out.accepted} messages accepted; {out.silent} silent; "
                  f"{len(out.malformed)} malformed replies; {out.refused} refused; "
                  f"codes {dict(sorted(out.codes.items()))}")
            assert srv.proc.poll() is None, "sluice serve died under the fuzzer"
            assert tally.sessions == SESSIONS and out.refused == 0
            assert out.malformed == [] and out.silent == 0
            # The generator reached the deep states: content was taken and refused.
            assert out.accepted > 0 and out.codes[354] > 0 and out.codes[552] > 0

            with smtplib.SMTP("127.0.0.1", srv.port, local_hostname="after.test",
                              timeout=30) as client:
                client.sendmail("a@sender.example", ["after@dest.example"],
                                b"Subject: after the fuzz\r\nX-After: yes\r\n\r\nhello\r\n")
            assert wait_until(lambda: any(b"X-After: yes" in m.data
                                          for m in list(sink.messages)), 60)
        finally:
            code = srv.stop()
        assert code == 0
        log = "\n".join(srv.output)
        for marker in ("Traceback", "session error"):
            at = log.find(marker)
            assert at < 0, log[max(0, at - 500):at + 3000]
    finally:
        sink.stop_thread()
