"""An hour of one newsletter, as Sluice's accounting log: examples/analytics/README.md.

Google throttles by rate after 30 messages a minute, example.net refuses
connections after 8 a minute, example.org takes everything; a share of
the recipients are unknown (550 5.1.1) or have a full mailbox (552 5.2.2).

Usage: python examples/analytics/make_scenario.py LOGDIR
"""

from __future__ import annotations

import random
import sys

from sluice.accounting import AccountingLog, EventKind, make_event
from sluice.model import QueueEntry, QueueState, Reply

T0 = 1_795_000_000.0
OK = Reply(250, "2.0.0", "OK 1795000000 x1y2z3a4b5.42 - gsmtp")
RATE = Reply(421, "4.7.0", "[192.0.2.1] Our system has detected an unusual rate of unsolicited "
             "mail originating from your IP address. To protect our users from spam, mail sent "
             "from your IP address has been temporarily rate limited. a1b2c3d4e5 - gsmtp")
CONN = Reply(421, "4.7.0", "Too many concurrent SMTP connections from this IP address; "
             "please try again later")
UNKNOWN = Reply(550, "5.1.1", "The email account that you tried to reach does not exist.")
# (domain, MX, messages per minute, throttled after, throttle reply, delivery seconds)
DESTINATIONS = (
    ("gmail.com", "gmail-smtp-in.l.google.com", 40, 30, RATE, 0.4),
    ("example.net", "mx1.example.net", 12, 8, CONN, 4.0),
    ("example.org", "mx.example.org", 10, 99, None, 0.4),
)


def main(logdir: str) -> int:
    rng = random.Random(7)
    log = AccountingLog(logdir, rotate="hourly", node="mx1")
    events = []
    n = 0
    for minute in range(60):
        for dom, mx, per_min, throttle_after, throttle, seconds in DESTINATIONS:
            for i in range(per_min):
                n += 1
                at = T0 + minute * 60 + i * (60 / per_min)
                ip = f"192.0.2.{1 + n % 2}"
                local = rng.choice([f"bad{n % 7}", f"full{n % 5}", f"user{n}"])
                entry = QueueEntry(spid=f"{n:012X}", idx=0, sender="news@shop.example",
                                   recipient=f"{local}@{dom}", state=QueueState.ACTIVE,
                                   arrival_at=at - 2, next_attempt_at=at, tenantid="shop",
                                   jobid="newsletter-47", localip=(ip,), size=24000)
                events.append(make_event(EventKind.RECEIVED, entry, at - 2))
                attempt = {"localip": ip, "remotemx": mx, "remoteip": f"203.0.113.{n % 200}",
                           "attempt": 1}
                if throttle is not None and i >= throttle_after:
                    events.append(make_event(EventKind.DEFERRED, entry, at, reply=throttle,
                                             duration_s=0.2, **attempt))
                elif local.startswith("bad"):
                    events.append(make_event(EventKind.BOUNCED, entry, at, reply=UNKNOWN,
                                             duration_s=0.3, **attempt))
                elif local.startswith("full"):
                    full = Reply(552, "5.2.2", f"<{entry.recipient}>: mailbox full")
                    events.append(make_event(EventKind.BOUNCED, entry, at, reply=full,
                                             duration_s=0.3, **attempt))
                else:
                    events.append(make_event(EventKind.DELIVERED, entry, at, reply=OK,
                                             duration_s=seconds, **attempt))
    log.record(events, now=T0)
    log.close()
    print(f"{len(events)} events in {logdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "scenario-log"))
