"""Any sequence of queue operations keeps every recipient in exactly one state.

A hypothesis state machine drives sluice.queue over a real store on disk
(submit, claim, outcomes, operator actions, expiry, NDRs, restart) and keeps
a model of where each recipient must be.  After every step: the listing
equals the model (nothing lost, nothing invented, each recipient once),
the counts per state equal the listing, the message count equals the
distinct SPIDs listed, every listed message has its content, and the
oldest deferred entry the store names is the first arrival listed.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sluice.model import Delivered, PermFail, QueueState, Reply, Selector, Submission, TempFail
from sluice.queue import AttemptResult, Queue
from sluice.spool import spid_time
from sluice.store import ACTION_STATES, Action
from tests.integration.stores import FLAVOURS, flavour_config

pytestmark = pytest.mark.property

S = QueueState
DOMAINS = ("a.example", "b.example", "c.example")
TENANTS = ("t1", "t2")


@dataclass
class Rcpt:
    state: QueueState
    domain: str
    tenant: str
    attempts: int = 0


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def _machine(flavour: str) -> type[RuleBasedStateMachine]:
    class QueueMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.dir = Path(tempfile.mkdtemp(prefix="sluice-prop-"))
            self.cfg = flavour_config(flavour, self.dir, queue={"retry_delays": "10m | 1h",
                                                                "retry_maxtime": "1d"})
            self.clock = Clock()
            self.queue = Queue.open(self.cfg, clock=self.clock)
            self.model: dict[str, Rcpt] = {}

        def teardown(self) -> None:
            self.queue.close()
            shutil.rmtree(self.dir, ignore_errors=True)

        # -- operations ------------------------------------------------------------

        @rule(n=st.integers(1, 3), domains=st.lists(st.sampled_from(DOMAINS), min_size=3,
                                                    max_size=3),
              tenant=st.sampled_from(TENANTS), mode=st.sampled_from(["now", "hold", "delay"]))
        def submit(self, n: int, domains: list[str], tenant: str, mode: str) -> None:
            rcpts = tuple(f"u{i}@{domains[i]}" for i in range(n))
            sub = Submission("s@example.org", rcpts, tenantid=tenant, hold=mode == "hold",
                             delay_s=600 if mode == "delay" else 0)
            acc = self.queue.submit(sub, b"Subject: p\r\n\r\nbody\r\n")
            state = {"now": S.INCOMING, "hold": S.HOLD, "delay": S.DEFERRED}[mode]
            for qid, rcpt in zip(acc.qids, rcpts, strict=True):
                self.model[qid] = Rcpt(state, rcpt.split("@")[1], tenant)

        @rule(k=st.integers(1, 5))
        def claim(self, k: int) -> None:
            for e in self.queue.claim(k):
                assert self.model[e.qid].state in (S.INCOMING, S.DEFERRED), e
                self.model[e.qid].state = S.ACTIVE

        @rule(kinds=st.lists(st.sampled_from(["ok", "temp", "perm"]), min_size=1, max_size=6))
        def deliver(self, kinds: list[str]) -> None:
            active = [e for e in self.queue.store.entries(Selector(states=(S.ACTIVE,)))]
            results = []
            for e, kind in zip(active, kinds, strict=False):
                outcome = {"ok": Delivered(Reply(250, "2.0.0", "ok")),
                           "temp": TempFail(Reply(451, "4.3.0", "later")),
                           "perm": PermFail(Reply(550, "5.1.1", "no"))}[kind]
                results.append(AttemptResult(e, outcome))
            for res, state in self.queue.record(results):
                r = self.model[res.entry.qid]
                if state is None:
                    del self.model[res.entry.qid]
                else:
                    r.state = state

        @rule(action=st.sampled_from([Action.HOLD, Action.RELEASE, Action.RETRY,
                                      Action.DELETE, Action.BOUNCE, Action.PRIORITY]),
              domain=st.none() | st.sampled_from(DOMAINS),
              tenant=st.none() | st.sampled_from(TENANTS))
        def operator(self, action: Action, domain: str | None, tenant: str | None) -> None:
            if domain is None and tenant is None:
                domain = DOMAINS[0]
            touched = self.queue.act(Selector(domain=domain, tenantid=tenant), action,
                                     priority=1 if action is Action.PRIORITY else None)
            expected = {q for q, r in self.model.items()
                        if (domain is None or r.domain == domain)
                        and (tenant is None or r.tenant == tenant)
                        and r.state in ACTION_STATES[action]}
            assert {e.qid for e in touched} == expected
            for e in touched:
                r = self.model[e.qid]
                if action is Action.HOLD:
                    r.state = S.HOLD
                elif action is Action.RELEASE:
                    r.state = S.DEFERRED if e.attempts else S.INCOMING
                elif action is Action.DELETE:
                    del self.model[e.qid]
                elif action is Action.BOUNCE:
                    r.state = S.BOUNCE

        @rule()
        def bounces(self) -> None:
            before = {e.qid for e in self.queue.store.entries(Selector())}
            self.queue.run_bounces()
            for q in [q for q, r in self.model.items() if r.state is S.BOUNCE]:
                del self.model[q]
            for e in self.queue.store.entries(Selector()):
                if e.qid not in before:  # a new NDR
                    assert e.is_report and e.sender == ""
                    self.model[e.qid] = Rcpt(S.INCOMING, e.domain, e.tenantid)

        @rule(seconds=st.sampled_from([60, 600, 3600, 86400]))
        def time_passes(self, seconds: int) -> None:
            self.clock.now += seconds

        @rule()
        def expire(self) -> None:
            expired = self.queue.expire()
            if expired:
                for e in self.queue.store.entries(Selector(states=(S.BOUNCE,))):
                    self.model[e.qid].state = S.BOUNCE

        @precondition(lambda self: len(self.model) > 0)
        @rule()
        def restart(self) -> None:
            self.queue.close()
            self.queue = Queue.open(self.cfg, clock=self.clock)
            self.queue.recover()
            for r in self.model.values():
                if r.state in (S.ACTIVE, S.DELIVERING):
                    r.state = S.DEFERRED

        # -- invariants ---------------------------------------------------------------

        @invariant()
        def listing_equals_the_model(self) -> None:
            listed = [(e.qid, e.state) for e in self.queue.store.entries(Selector())]
            qids = [q for q, _ in listed]
            assert len(qids) == len(set(qids)), "a recipient is listed twice"
            assert dict(listed) == {q: r.state for q, r in self.model.items()}

        @invariant()
        def counts_equal_the_listing(self) -> None:
            entries = list(self.queue.store.entries(Selector()))
            c = self.queue.store.count()
            assert dict(Counter(e.state for e in entries)) == {s: c[s] for s in S if c[s]}
            assert c.messages == len({e.spid for e in entries})
            for spid in {e.spid for e in entries}:
                with self.queue.store.open_content(spid) as stream:
                    assert stream.read(1)

        @invariant()
        def the_oldest_deferred_is_the_first_arrival_listed(self) -> None:
            # kv keeps an index of the deferred by arrival for it (and for
            # expiry): it must follow every transition, restart included.
            # fs has only names, and takes the SPID's time (which, drawn from
            # the real clock, differs from this fake one's arrival).
            deferred = [spid_time(e.spid) if flavour == "fs" else e.arrival_at
                        for e in self.queue.store.entries(Selector(states=(S.DEFERRED,)))]
            oldest = self.queue.store.oldest().get(S.DEFERRED)
            if not deferred:
                assert oldest is None
            else:
                assert oldest == pytest.approx(min(deferred), abs=1e-3)

    return QueueMachine


for _flavour in FLAVOURS:
    _cls = _machine(_flavour)
    _cls.TestCase.settings = settings(
        max_examples=40, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow])
    globals()[f"TestQueueStates_{_flavour}"] = _cls.TestCase
