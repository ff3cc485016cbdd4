"""Hooks: loading from config with clear errors, and the fail-safe way they run."""

from __future__ import annotations

import asyncio
import logging
import textwrap
from pathlib import Path

import pytest

from sluice.config import ConfigError, config_from_dict
from sluice.hooks import (
    HOOK_FAILED_REPLY,
    Accept,
    Bounce,
    Defer,
    Drop,
    EndOfData,
    Hold,
    Hooks,
    PostDelivery,
    Proceed,
    Reject,
    load_hook,
)
from sluice.model import Delivered, PermFail, QueueEntry, QueueState, Reply, Submission, TempFail

pytestmark = pytest.mark.unit

HOOK_FILE = textwrap.dedent('''
    from sluice.hooks import Accept, Reject, Proceed, Hold, Defer, Drop, Bounce
    from sluice.model import Reply, TempFail

    def eod(ctx):
        if ctx.sender == "spam@bad.test":
            return Reject(Reply(550, "5.7.1", "no thanks"))
        subject = ctx.headers()["Subject"] or ""
        if subject.startswith("bulk"):
            return Accept(tenantid="t1", jobid="j1", localip="127.0.0.2", priority=0)
        return None

    async def pre(ctx):
        domain = ctx.entry.domain
        if domain == "relay.test":
            return Proceed(nexthop="smtp:[127.0.0.1]:2526", localip=["127.0.0.3"])
        if domain == "hold.test":
            return Hold("looks odd")
        if domain == "later.test":
            return Defer()
        if domain == "drop.test":
            return Drop("test")
        if domain == "bounce.test":
            return Bounce()
        if domain == "boom.test":
            raise RuntimeError("operator bug")
        if domain == "wrong.test":
            return "yes please"
        return None

    def post(ctx):
        if ctx.outcome.reply.code == 550 and "greylist" in ctx.outcome.reply.text:
            return TempFail(Reply(451, "4.7.1", ctx.outcome.reply.text))
        return None

    not_callable = 42

    def two_args(a, b):
        return None
''')


def entry(domain: str = "example.test", attempts: int = 0) -> QueueEntry:
    return QueueEntry(spid="0123456789ABCDEF", idx=0, sender="a@src.test",
                      recipient=f"b@{domain}", state=QueueState.ACTIVE,
                      arrival_at=0.0, next_attempt_at=0.0, attempts=attempts)


@pytest.fixture
def hook_dir(tmp_path: Path) -> Path:
    (tmp_path / "myhooks.py").write_text(HOOK_FILE)
    return tmp_path


def hooks_for(hook_dir: Path, **delivery: str) -> Hooks:
    cfg = config_from_dict(
        {"smtpd": {"hook": "myhooks.py:eod"}, "delivery": delivery},
        source=str(hook_dir / "sluice.yaml"), base_dir=hook_dir)
    return Hooks.from_config(cfg)


# -- loading -------------------------------------------------------------------


def test_from_config_loads_file_hooks_relative_to_config(hook_dir: Path) -> None:
    hooks = hooks_for(hook_dir, pre_hook="myhooks.py:pre", post_hook="./myhooks.py:post")
    assert hooks.end_of_data is not None and hooks.end_of_data.__name__ == "eod"
    assert hooks.pre_delivery is not None and hooks.pre_delivery.__name__ == "pre"
    assert hooks.post_delivery is not None and hooks.post_delivery.__name__ == "post"


def test_hooks_of_one_file_share_its_module(hook_dir: Path) -> None:
    hooks = hooks_for(hook_dir, pre_hook="myhooks.py:pre", post_hook="myhooks.py:post")
    assert hooks.pre_delivery is not None and hooks.post_delivery is not None
    assert hooks.pre_delivery.__globals__ is hooks.post_delivery.__globals__


def test_no_hooks_configured() -> None:
    hooks = Hooks.from_config(config_from_dict({}))
    assert hooks == Hooks()


def test_module_hook_is_imported_from_sys_path() -> None:
    fn = load_hook("json:dumps", keypath="delivery.pre_hook")
    assert fn([1]) == "[1]"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nosuchmodule_xyz:fn", "cannot import 'nosuchmodule_xyz'"),
        ("myhooks.py:missing", "has no attribute 'missing'"),
        ("myhooks.py:not_callable", "is not callable"),
        ("myhooks.py:two_args", "must take exactly one argument"),
        ("nofile.py:fn", "no such file"),
        ("just_a_name", "is not module:function"),
    ],
)
def test_load_errors_name_the_file_and_key(hook_dir: Path, spec: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        hooks_for(hook_dir, pre_hook=spec)
    text = str(info.value)
    assert text.startswith(f"{hook_dir / 'sluice.yaml'}: delivery.pre_hook: ")
    assert message in text


def test_a_hook_file_that_fails_to_import_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise ImportError('missing dependency foo')\n")
    with pytest.raises(ConfigError, match=r"smtpd\.hook: .*broken\.py failed to load: "
                                          r"ImportError: missing dependency foo"):
        load_hook("broken.py:fn", keypath="smtpd.hook", base_dir=tmp_path)


# -- decision values -----------------------------------------------------------------


def test_accept_applies_only_the_fields_it_sets() -> None:
    sub = Submission(sender="a@x.test", recipients=("b@y.test",), tenantid="old", priority=1)
    out = Accept(jobid="j9", localip="127.0.0.2", hold=True, delay_s=60).apply(sub)
    assert out == Submission(sender="a@x.test", recipients=("b@y.test",), tenantid="old",
                             jobid="j9", localip=("127.0.0.2",), priority=1, hold=True,
                             delay_s=60.0)
    assert Accept().apply(sub) is sub


@pytest.mark.parametrize(
    "make",
    [
        lambda: Reject(Reply(250, "2.0.0", "ok")),
        lambda: Defer(Reply(550, "5.0.0", "no")),
        lambda: Bounce(Reply(451, "4.0.0", "later")),
        lambda: Accept(reply=Reply(451)),
        lambda: Accept(priority=5),
        lambda: Accept(delay_s=-1),
    ],
)
def test_decisions_refuse_contradictory_values(make: object) -> None:
    with pytest.raises(ValueError):
        make()  # type: ignore[operator]


# -- running -------------------------------------------------------------------------


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def eod_context(sender: str, subject: str) -> EndOfData:
    sub = Submission(sender=sender, recipients=("r@y.test",))
    header = f"From: {sender}\r\nSubject: {subject}\r\n\r\n".encode()
    return EndOfData(submission=sub, client_ip="127.0.0.1", header=header)


def test_end_of_data_decisions(hook_dir: Path) -> None:
    hooks = hooks_for(hook_dir)
    assert run(hooks.run_end_of_data(eod_context("spam@bad.test", "x"))) == Reject(
        Reply(550, "5.7.1", "no thanks"))
    assert run(hooks.run_end_of_data(eod_context("a@ok.test", "bulk mail"))) == Accept(
        tenantid="t1", jobid="j1", localip=("127.0.0.2",), priority=0)
    assert run(hooks.run_end_of_data(eod_context("a@ok.test", "hello"))) == Accept()
    assert run(Hooks().run_end_of_data(eod_context("spam@bad.test", "x"))) == Accept()


def test_pre_delivery_decisions_from_an_async_hook(hook_dir: Path) -> None:
    hooks = hooks_for(hook_dir, pre_hook="myhooks.py:pre")
    assert run(hooks.run_pre_delivery(entry("relay.test"))) == Proceed(
        nexthop="smtp:[127.0.0.1]:2526", localip=("127.0.0.3",))
    assert run(hooks.run_pre_delivery(entry("hold.test"))) == Hold("looks odd")
    assert run(hooks.run_pre_delivery(entry("later.test"))) == Defer()
    assert run(hooks.run_pre_delivery(entry("drop.test"))) == Drop("test")
    assert isinstance(run(hooks.run_pre_delivery(entry("bounce.test"))), Bounce)
    assert run(hooks.run_pre_delivery(entry("example.test"))) == Proceed()


def test_a_failing_pre_delivery_hook_defers_and_logs(
        hook_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    hooks = hooks_for(hook_dir, pre_hook="myhooks.py:pre")
    with caplog.at_level(logging.ERROR, logger="sluice.hooks"):
        assert run(hooks.run_pre_delivery(entry("boom.test"))) == Defer(HOOK_FAILED_REPLY)
        assert run(hooks.run_pre_delivery(entry("wrong.test"))) == Defer(HOOK_FAILED_REPLY)
    assert "operator bug" in caplog.text
    assert "returned 'yes please'" in caplog.text


def test_post_delivery_may_override_and_keeps_the_outcome_otherwise(hook_dir: Path) -> None:
    hooks = hooks_for(hook_dir, post_hook="myhooks.py:post")
    grey = PermFail(Reply(550, "5.7.1", "greylisted, come back"))
    assert run(hooks.run_post_delivery(PostDelivery(entry(), grey))) == TempFail(
        Reply(451, "4.7.1", "greylisted, come back"))
    ok = Delivered(Reply(250, "2.0.0", "ok"))
    assert run(hooks.run_post_delivery(PostDelivery(entry(), ok))) is ok


def test_a_failing_post_delivery_hook_keeps_the_original(
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(ctx: PostDelivery) -> None:
        raise KeyError("x")

    hooks = Hooks(post_delivery=broken)
    bad = PermFail(Reply(550, "5.1.1", "no such user"))
    with caplog.at_level(logging.ERROR, logger="sluice.hooks"):
        assert run(hooks.run_post_delivery(PostDelivery(entry(), bad))) is bad
    assert "post-delivery hook" in caplog.text and "KeyError" in caplog.text


def test_a_failing_end_of_data_hook_answers_451(caplog: pytest.LogCaptureFixture) -> None:
    async def broken(ctx: EndOfData) -> Accept:
        raise OSError("database down")

    with caplog.at_level(logging.ERROR, logger="sluice.hooks"):
        got = run(Hooks(end_of_data=broken).run_end_of_data(eod_context("a@b.test", "s")))
    assert got == Reject(HOOK_FAILED_REPLY)
    assert "database down" in caplog.text
