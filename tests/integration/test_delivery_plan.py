"""Hooks, routing and grouping around the agent, and a round trip through a real queue."""

from __future__ import annotations

import functools
import io
import textwrap
from pathlib import Path
from typing import Any

import pytest

from sluice.config import ConfigError, config_from_dict
from sluice.delivery import DeliveryAgent, DeliveryRequest, Planner, Router
from sluice.hooks import Drop, Hold, Hooks
from sluice.model import (
    Delivered,
    PermFail,
    QueueEntry,
    QueueState,
    Reply,
    Selector,
    Submission,
    TempFail,
)
from sluice.queue import Queue
from sluice.scheduler.events import Route, Transport
from tests.conftest import make_config
from tests.integration.test_delivery_peers import SinkHandler, run, sink

pytestmark = pytest.mark.integration

HOOKS = textwrap.dedent('''
    from sluice.hooks import Proceed, Hold, Defer, Drop, Bounce
    from sluice.model import Reply, TempFail

    def pre(ctx):
        local = ctx.entry.recipient.split("@")[0]
        if local == "hold":
            return Hold("review")
        if local == "drop":
            return Drop()
        if local == "later":
            return Defer(Reply(451, "4.7.0", "not now"))
        if local == "never":
            return Bounce(Reply(550, "5.7.1", "not ever"))
        if local == "relay":
            return Proceed(nexthop="smtp:[127.0.0.7]:2526", localip=("127.0.0.2",),
                           transportid="relayed")
        if local == "badhop":
            return Proceed(nexthop="carrier-pigeon:home")
        return None

    def post(ctx):
        reply = ctx.outcome.reply
        if reply.code >= 500 and "greylist" in reply.text:
            return TempFail(Reply(451, "4.7.1", reply.text))
        return None
''')


def entry(rcpt: str, spid: str = "0123456789ABCDEF", idx: int = 0, **kw: Any) -> QueueEntry:
    return QueueEntry(spid=spid, idx=idx, sender="s@src.test", recipient=rcpt,
                      state=QueueState.ACTIVE, arrival_at=0.0, next_attempt_at=0.0, **kw)


@pytest.fixture
def planner(tmp_path: Path) -> Planner:
    (tmp_path / "hooks.py").write_text(HOOKS)
    cfg = config_from_dict({"delivery": {
        "pre_hook": "hooks.py:pre", "post_hook": "hooks.py:post",
        "transport": {"a.test": "smtp:[127.0.0.1]:2600", "b.test": "smtp:[127.0.0.1]:2600",
                      "c.test": "lmtp:127.0.0.1:2424",
                      "gone.test": "error:5.1.2 no such domain, greylist anyway",
                      "bounce.test": "error:5.1.2 no such domain"}}},
        source=str(tmp_path / "sluice.yaml"), base_dir=tmp_path)
    return Planner(Router.from_config(cfg), Hooks.from_config(cfg))


def test_plan_groups_one_message_per_domain_and_route(planner: Planner) -> None:
    m1, m2 = "0123456789ABCDEF", "FEDCBA9876543210"
    entries = [
        entry("x@a.test", m1, 0), entry("y@a.test", m1, 1), entry("z@b.test", m1, 2),
        entry("x@a.test", m2, 0), entry("w@c.test", m2, 1),
        entry("v@a.test", m2, 2, localip=("127.0.0.3",)),
    ]
    plan = run(planner.plan(entries))
    assert plan.settled == ()
    got = sorted((j.spid, tuple(e.recipient for e in j.entries), j.route.destination, j.localip)
                 for j in plan.jobs)
    assert got == [
        (m1, ("x@a.test", "y@a.test"), "smtp:[127.0.0.1]:2600", ()),
        (m1, ("z@b.test",), "smtp:[127.0.0.1]:2600", ()),
        (m2, ("v@a.test",), "smtp:[127.0.0.1]:2600", ("127.0.0.3",)),
        (m2, ("w@c.test",), "lmtp:[127.0.0.1]:2424", ()),
        (m2, ("x@a.test",), "smtp:[127.0.0.1]:2600", ()),
    ]
    lmtp = next(j for j in plan.jobs if j.route.transport is Transport.LMTP)
    assert lmtp.scheduler_route() == Route(
        recipientdomain="c.test", remoteip="127.0.0.1", remotemx="127.0.0.1",
        destination="lmtp:[127.0.0.1]:2424", transport=Transport.LMTP)


def test_pre_delivery_decisions(planner: Planner) -> None:
    rcpts = ["hold@a.test", "drop@a.test", "later@a.test", "never@a.test", "relay@a.test",
             "badhop@a.test", "fine@a.test"]
    plan = run(planner.plan([entry(r, idx=i) for i, r in enumerate(rcpts)]))
    settled = {s.entry.recipient: s.decision for s in plan.settled}
    assert settled["hold@a.test"] == Hold("review")
    assert settled["drop@a.test"] == Drop()
    assert settled["later@a.test"] == TempFail(Reply(451, "4.7.0", "not now"))
    assert settled["never@a.test"] == PermFail(Reply(550, "5.7.1", "not ever"))
    bad = settled["badhop@a.test"]
    assert isinstance(bad, TempFail) and "carrier-pigeon" in bad.reply.text
    jobs = {j.entries[0].recipient: j for j in plan.jobs}
    assert set(jobs) == {"relay@a.test", "fine@a.test"}
    relay = jobs["relay@a.test"]
    assert (relay.route.destination, relay.localip, relay.transportid) == (
        "smtp:[127.0.0.7]:2526", ("127.0.0.2",), "relayed")
    assert relay.scheduler_route().transportid == "relayed"
    with pytest.raises(TypeError):
        next(s for s in plan.settled if isinstance(s.decision, Hold)).attempt_result()
    later = next(s for s in plan.settled if s.entry.recipient == "later@a.test")
    assert later.attempt_result().attempted is False


def test_routing_failures_go_through_the_post_delivery_hook(planner: Planner) -> None:
    plan = run(planner.plan([entry("a@gone.test"), entry("b@bounce.test", idx=1)]))
    got = {s.entry.recipient: s.decision for s in plan.settled}
    # The post hook turned the "greylist" bounce into a deferral; the other stays.
    assert got == {
        "a@gone.test": TempFail(Reply(451, "4.7.1", "no such domain, greylist anyway")),
        "b@bounce.test": PermFail(Reply(550, "5.1.2", "no such domain")),
    }


def test_finish_applies_the_post_delivery_hook_to_real_replies(planner: Planner) -> None:
    async def scenario() -> list[Any]:
        handler = SinkHandler(rcpt_replies={"grey@a.test": "550 5.7.1 greylisted, retry",
                                            "gone@a.test": "550 5.1.1 unknown user"})
        async with sink(handler) as s:
            cfg = config_from_dict({"node": {"hostname": "client.test"}, "delivery": {
                "starttls": "none", "transport": {"a.test": f"smtp:[127.0.0.1]:{s.port}"}}})
            p = Planner(Router.from_config(cfg), planner.hooks)
            plan = await p.plan([entry("ok@a.test"), entry("grey@a.test", idx=1),
                                 entry("gone@a.test", idx=2)])
            (job,) = plan.jobs
            agent = DeliveryAgent.from_config(cfg)
            result = await agent.deliver(DeliveryRequest(
                job.route, job.entries, lambda: io.BytesIO(b"Subject: x\r\n\r\nx\r\n")))
            await agent.close()
            return await p.finish(result)

    results = run(scenario())
    got = {r.entry.recipient: (type(r.outcome), r.outcome.reply.code) for r in results}
    assert got == {"ok@a.test": (Delivered, 250), "grey@a.test": (TempFail, 451),
                   "gone@a.test": (PermFail, 550)}
    assert all(r.attempted and r.remoteip == "127.0.0.1" for r in results)


def test_router_config_errors_name_the_key(tmp_path: Path) -> None:
    cfg = config_from_dict({"delivery": {"transport": {"x.test": "smtp:[1.2.3.4"}}},
                           source="/etc/sluice.yaml")
    with pytest.raises(ConfigError, match=r"^/etc/sluice\.yaml: delivery\.transport: key "
                                          r"'x\.test': .*missing '\]'"):
        Router.from_config(cfg)
    cfg = config_from_dict({"delivery": {"resolver": {"nameservers": ["dns.example"]}}},
                           source="/etc/sluice.yaml")
    with pytest.raises(ConfigError, match=r"delivery\.resolver\.nameservers: .*dns\.example"):
        Router.from_config(cfg)


def test_a_queued_message_is_streamed_from_the_spool_and_recorded(tmp_path: Path) -> None:
    body = b"Subject: from the queue\r\n\r\n.dot\r\n" + b"line\r\n" * 20_000

    async def scenario(queue: Queue) -> None:
        handler = SinkHandler(rcpt_replies={"busy@a.test": "452 4.2.2 full"})
        async with sink(handler) as s:
            cfg = make_config(tmp_path, node={"hostname": "client.test"}, delivery={
                "starttls": "none", "transport": {"*": f"smtp:[127.0.0.1]:{s.port}"}})
            planner = Planner(Router.from_config(cfg), Hooks.from_config(cfg))
            agent = DeliveryAgent.from_config(cfg)
            plan = await planner.plan(queue.claim(100))
            (job,) = plan.jobs
            result = await agent.deliver(DeliveryRequest(
                job.route, job.entries, functools.partial(queue.store.open_content, job.spid)))
            queue.record(await planner.finish(result))
            await agent.close()
        assert handler.messages[0].data == body
        assert handler.messages[0].recipients == ("ok@a.test",)

    cfg = make_config(tmp_path)
    with Queue.open(cfg) as queue:
        accepted = queue.submit(Submission("s@src.test", ("ok@a.test", "busy@a.test")), body)
        run(scenario(queue))
        left = list(queue.store.entries(Selector()))
        assert [(e.recipient, e.state) for e in left] == [("busy@a.test", QueueState.DEFERRED)]
        assert left[0].spid == accepted.spid and left[0].attempts == 1
        reply = left[0].last_reply
        assert reply is not None and (reply.code, reply.enhanced) == (452, "4.2.2")
        assert (reply.text, reply.remote_mta) == ("full", "127.0.0.1")
        assert reply.attempt_at is not None  # recorded with the time of the attempt
