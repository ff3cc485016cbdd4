"""Operator hooks: Python callables named in the configuration (the seeds' "scripts").

SUMMARY
    Hooks.from_config(config) -> Hooks, or ConfigError naming the key.
    End of DATA:     EndOfData -> Accept | Reject | None
    Pre-delivery:    PreDelivery -> Proceed | Hold | Defer | Drop | Bounce | None
    Post-delivery:   PostDelivery -> Delivered | TempFail | PermFail | Shape | None

DESCRIPTION
    Three places in a message's life where an operator's code decides, as
    Halon's scripts do:

    smtpd.hook          end of DATA, once per message, before the message is
                        queued.  It may set the queue fields (tenantid, jobid,
                        transportid, localip, priority), hold the message or
                        delay its first attempt, or reject it with a reply.
    delivery.pre_hook   once per recipient entry and attempt, before routing
                        (sluice.delivery.Planner.plan calls it).
                        It may reroute (a transport(5) nexthop such as
                        ``smtp:[10.0.0.5]:25``), choose the source IPs, change
                        the transportid, or hold, defer, drop or bounce the
                        entry instead of delivering it.
    delivery.post_hook  once per recipient entry and attempt, after the
                        outcome is known -- also when no connection was made
                        (routing failed, dead destination); Planner.finish
                        and Planner.settle call it.  It sees the
                        outcome and may replace it, e.g. treat a 5xx as 4xx.

    A hook is named as ``package.module:function`` (imported from sys.path)
    or ``/path/to/file.py:function`` (a relative path is taken from the
    directory of the configuration file).  It takes one argument, the
    context value, and returns a decision value; returning None means "carry
    on as if there were no hook".  A hook may be a coroutine function; a
    plain function runs inline on the event loop, so it must be quick.

STRATEGIES
    Fail safe, not open.  A hook that raises or returns a value of the wrong
    type never loses mail and never lets mail through unchecked: end of
    DATA answers 451 4.3.0, pre-delivery defers the entry (451 4.3.0), and
    post-delivery keeps the original outcome.  The error is logged with the
    hook's name and traceback, once per call.

    Load early.  Hooks are imported when the configuration is loaded, so a
    typo is an error at start-up that names the file and the key path
    (``delivery.pre_hook``), not a surprise at the first message.

INVARIANTS
    Context and decision values are frozen dataclasses.  The names and
    fields of this module are a contract with operators' code and with
    sluice.smtpd: add fields with defaults, never remove or rename.

SEE ALSO
    docs/delivery.md (hooks), sluice.delivery, sluice.smtpd
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import logging
import re
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.message import Message
from email.parser import BytesHeaderParser
from email.policy import compat32
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from sluice.model import Delivered, Outcome, PermFail, QueueEntry, Reply, Submission, TempFail

if TYPE_CHECKING:
    from sluice.config import Config

__all__ = [
    "HOOK_FAILED_REPLY",
    "Accept",
    "Bounce",
    "Defer",
    "Drop",
    "EndOfData",
    "EndOfDataDecision",
    "EndOfDataHook",
    "Hold",
    "Hooks",
    "PostDelivery",
    "PostDeliveryHook",
    "PreDecision",
    "PreDelivery",
    "PreDeliveryHook",
    "Proceed",
    "Reject",
    "Shape",
    "load_hook",
]

log = logging.getLogger("sluice.hooks")

#: What the client (end of DATA) or the queue (pre-delivery) is told when a
#: hook fails: a local, temporary error (RFC 3463 X.3.0).
HOOK_FAILED_REPLY = Reply(451, "4.3.0", "local policy hook failed, try again later")
_DEFER_REPLY = Reply(451, "4.7.0", "deferred by pre-delivery hook")
_BOUNCE_REPLY = Reply(550, "5.7.1", "rejected by pre-delivery hook")


def _as_ips(value: tuple[str, ...] | list[str] | str | None) -> tuple[str, ...] | None:
    # Operators write localip=["10.0.0.1"] or "10.0.0.1"; keep one spelling.
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _check_reply(reply: Reply, classes: tuple[int, ...], what: str) -> None:
    if not isinstance(reply, Reply):
        raise TypeError(f"{what} needs a sluice.model.Reply, not {type(reply).__name__}")
    if reply.code // 100 not in classes:
        allowed = " or ".join(f"{c}xx" for c in classes)
        raise ValueError(f"{what} needs a {allowed} reply, not {reply.code}")


# --------------------------------------------------------------------------
# End of DATA (called by sluice.smtpd)


@dataclass(frozen=True, slots=True)
class EndOfData:
    """What the end-of-DATA hook sees: the message as it is about to be queued.

    ``submission`` is what would be queued without the hook (envelope and
    default queue fields).  ``header`` is the raw header block as received
    (up to and including the blank line; at most the first 64 KiB), before
    our Received header is added; ``headers()`` parses it.  ``client_ip``
    and ``client_port`` are the peer; ``helo`` what it said; ``auth_user``
    the authenticated user or None; ``tls`` whether the session was
    encrypted; ``size`` the message size in bytes.
    """

    submission: Submission
    client_ip: str
    client_port: int = 0
    helo: str = ""
    auth_user: str | None = None
    tls: bool = False
    size: int = 0
    header: bytes = b""
    smtputf8: bool = False

    @property
    def sender(self) -> str:
        """The envelope sender of the submission."""
        return self.submission.sender

    @property
    def recipients(self) -> tuple[str, ...]:
        """The envelope recipients of the submission."""
        return self.submission.recipients

    def headers(self) -> Message:
        """The header block parsed into an email.message.Message (no body)."""
        return BytesHeaderParser(policy=compat32).parsebytes(self.header)


@dataclass(frozen=True, slots=True)
class Accept:
    """Queue the message; every field left as None keeps the submission's value.

    ``hold``: queue it in the hold state.  ``delay_s``: first attempt no
    sooner than this many seconds from now.  ``reply``: an optional 2xx
    reply text to send instead of the default (the message is still queued
    before it is sent).
    """

    tenantid: str | None = None
    jobid: str | None = None
    transportid: str | None = None
    localip: tuple[str, ...] | None = None
    priority: int | None = None
    hold: bool | None = None
    delay_s: float | None = None
    reply: Reply | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "localip", _as_ips(self.localip))
        if self.priority is not None and self.priority not in (0, 1):
            raise ValueError(f"priority must be 0 or 1, not {self.priority}")
        if self.delay_s is not None and self.delay_s < 0:
            raise ValueError("delay_s must not be negative")
        if self.reply is not None:
            _check_reply(self.reply, (2,), "Accept")

    def apply(self, submission: Submission) -> Submission:
        """The submission with this decision's fields set."""
        changes: dict[str, Any] = {}
        for name in ("tenantid", "jobid", "transportid", "localip", "priority", "hold",
                     "delay_s"):
            value = getattr(self, name)
            if value is not None:
                changes[name] = value
        return dataclasses.replace(submission, **changes) if changes else submission


@dataclass(frozen=True, slots=True)
class Reject:
    """Refuse the message with ``reply`` (4xx: try later; 5xx: never)."""

    reply: Reply

    def __post_init__(self) -> None:
        _check_reply(self.reply, (4, 5), "Reject")


EndOfDataDecision: TypeAlias = Accept | Reject


# --------------------------------------------------------------------------
# Pre-delivery (called by the delivery runtime, before routing)


@dataclass(frozen=True, slots=True)
class PreDelivery:
    """What the pre-delivery hook sees: one recipient entry about to be tried.

    ``entry.attempts`` counts the attempts before this one.
    """

    entry: QueueEntry


@dataclass(frozen=True, slots=True)
class Proceed:
    """Deliver, optionally elsewhere or from elsewhere.

    ``nexthop``: a transport(5) value (``smtp:[192.0.2.1]:2525``,
    ``lmtp:127.0.0.1:24``, ``smtp:relay.example``) used instead of the
    transport map and MX lookup.  ``localip``: the source IPs to choose
    from.  ``transportid``: the transport id the pickup policies see.
    None keeps the entry's own value.
    """

    nexthop: str | None = None
    localip: tuple[str, ...] | None = None
    transportid: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "localip", _as_ips(self.localip))


@dataclass(frozen=True, slots=True)
class Hold:
    """Put the entry on hold until an operator releases it."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class Defer:
    """Do not try now; the retry rules pick the next attempt."""

    reply: Reply = _DEFER_REPLY

    def __post_init__(self) -> None:
        _check_reply(self.reply, (4,), "Defer")


@dataclass(frozen=True, slots=True)
class Drop:
    """Remove the entry without delivering it and without an NDR (logged)."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class Bounce:
    """Fail the entry for good: it bounces and the sender gets an NDR."""

    reply: Reply = _BOUNCE_REPLY

    def __post_init__(self) -> None:
        _check_reply(self.reply, (5,), "Bounce")


PreDecision: TypeAlias = Proceed | Hold | Defer | Drop | Bounce


# --------------------------------------------------------------------------
# Post-delivery (called by the delivery runtime, after every attempt)


@dataclass(frozen=True, slots=True)
class PostDelivery:
    """What the post-delivery hook sees: one recipient's outcome of one attempt.

    ``attempted`` is False when no connection was tried (routing failed,
    the destination is marked dead, the pre-delivery hook deferred).
    ``localip``, ``remotemx``, ``remoteip`` say where the attempt went
    ("" when unknown); ``duration_s`` how long it took.
    """

    entry: QueueEntry
    outcome: Outcome
    attempted: bool = True
    localip: str = ""
    remotemx: str = ""
    remoteip: str = ""
    duration_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Shape:
    """Post-delivery: take a traffic shaping action for the attempt's destination.

    As a rule would (docs/shaping.md); then keep the outcome, or replace it
    with ``outcome``.

    ``action``: suspend, suspend-tenant, suspend-job, backoff, condition
    (with ``concurrency`` and/or ``rate`` such as "1/10") or bounce.
    ``where``: the fields that name the group, from domain, mx, remoteip,
    localip, tenant, job; their values are the attempt's.  ``name`` is
    what the audit history and `why` call it (``hook:NAME``).
    """

    action: str
    duration_s: float = 3600.0
    where: tuple[str, ...] = ("domain",)
    name: str = ""
    note: str = ""
    concurrency: int | None = None
    rate: str | None = None
    outcome: Outcome | None = None


EndOfDataHook: TypeAlias = Callable[
    [EndOfData], EndOfDataDecision | Awaitable[EndOfDataDecision | None] | None]
PreDeliveryHook: TypeAlias = Callable[
    [PreDelivery], PreDecision | Awaitable[PreDecision | None] | None]
PostDeliveryHook: TypeAlias = Callable[
    [PostDelivery], Outcome | Shape | Awaitable[Outcome | Shape | None] | None]

_PRE_TYPES = (Proceed, Hold, Defer, Drop, Bounce)
_EOD_TYPES = (Accept, Reject)
_POST_TYPES = (Delivered, TempFail, PermFail)

_PROCEED = Proceed()
_ACCEPT = Accept()


# --------------------------------------------------------------------------
# Loading


def _hook_error(source: str, keypath: str, message: str) -> Exception:
    from sluice.config import ConfigError  # config imports nothing of ours; no cycle

    return ConfigError(source, keypath, message)


def load_hook(spec: str, *, keypath: str, source: str = "<config>",
              base_dir: str | Path = ".") -> Callable[[Any], Any]:
    """Import the callable ``spec`` names; ConfigError (naming ``keypath``) if not.

    ``spec`` is ``package.module:function`` or ``path/to/file.py:function``;
    the function may be a dotted attribute path (``module:Class.method``).
    """
    target, sep, attr = spec.strip().rpartition(":")
    if not sep or not target or not attr:
        raise _hook_error(source, keypath,
                          f"{spec!r} is not module:function or /path/file.py:function")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = (Path(base_dir) / Path(target).expanduser()).resolve()
        if not path.is_file():
            raise _hook_error(source, keypath, f"no such file: {path}")
        # One module per file, under a name derived from its path: the pre-
        # and post-delivery hooks of one file share its globals, and a
        # process that loads the file again finds the same name.
        name = "sluice_hook_" + re.sub(r"\W", "_", str(path))
        module = sys.modules.get(name)
        if module is None:
            spec_ = importlib.util.spec_from_file_location(name, path)
            if spec_ is None or spec_.loader is None:
                raise _hook_error(source, keypath, f"cannot load {path} as Python")
            module = importlib.util.module_from_spec(spec_)
            sys.modules[name] = module  # dataclasses and pickling look modules up by name
            try:
                spec_.loader.exec_module(module)
            except Exception as exc:
                sys.modules.pop(name, None)
                raise _hook_error(source, keypath,
                                  f"{path} failed to load: {type(exc).__name__}: {exc}"
                                  ) from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:
            raise _hook_error(source, keypath,
                              f"cannot import {target!r}: {type(exc).__name__}: {exc}"
                              ) from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise _hook_error(source, keypath, f"{target!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise _hook_error(source, keypath, f"{spec!r} is not callable")
    try:
        inspect.signature(obj).bind(None)
    except TypeError:
        raise _hook_error(source, keypath,
                          f"{spec!r} must take exactly one argument (the context)") from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return obj  # type: ignore[no-any-return]


async def _call(hook: Callable[[Any], Any], context: object) -> object:
    result = hook(context)
    if inspect.isawaitable(result):
        result = await result
    return result


def _hook_name(hook: Callable[..., Any]) -> str:
    module = getattr(hook, "__module__", "?")
    return f"{module}:{getattr(hook, '__qualname__', repr(hook))}"


@dataclass(frozen=True, slots=True)
class Hooks:
    """The configured hooks, and the safe way to call them.

    The run_* methods never raise for a hook's own failure (see STRATEGIES);
    cancellation passes through.
    """

    end_of_data: EndOfDataHook | None = None
    pre_delivery: PreDeliveryHook | None = None
    post_delivery: PostDeliveryHook | None = None
    #: Shape decisions of the post-delivery hook, with their context, until
    #: the queue manager takes them (sluice.shaping.runtime.Shaper.take).
    shaping: list[tuple[Shape, PostDelivery]] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: Config) -> Hooks:
        """Load smtpd.hook, delivery.pre_hook and delivery.post_hook."""
        def one(spec: str | None, keypath: str) -> Any:
            if not spec:
                return None
            return load_hook(spec, keypath=keypath, source=config.source,
                             base_dir=config.base_dir)

        return cls(
            end_of_data=one(config.smtpd.hook, "smtpd.hook"),
            pre_delivery=one(config.delivery.pre_hook, "delivery.pre_hook"),
            post_delivery=one(config.delivery.post_hook, "delivery.post_hook"),
        )

    async def run_end_of_data(self, context: EndOfData) -> EndOfDataDecision:
        """The hook's decision; Accept() without a hook, 451 4.3.0 if it fails."""
        hook = self.end_of_data
        if hook is None:
            return _ACCEPT
        try:
            result = await _call(hook, context)
        except Exception:
            log.exception("end-of-DATA hook %s raised", _hook_name(hook))
            return Reject(HOOK_FAILED_REPLY)
        if result is None:
            return _ACCEPT
        if not isinstance(result, _EOD_TYPES):
            log.error("end-of-DATA hook %s returned %r, not Accept, Reject or None",
                      _hook_name(hook), result)
            return Reject(HOOK_FAILED_REPLY)
        return result

    async def run_pre_delivery(self, entry: QueueEntry) -> PreDecision:
        """The hook's decision for ``entry``.

        Proceed() without a hook, Defer(451 4.3.0) if it fails.
        """
        hook = self.pre_delivery
        if hook is None:
            return _PROCEED
        try:
            result = await _call(hook, PreDelivery(entry))
        except Exception:
            log.exception("pre-delivery hook %s raised for %s", _hook_name(hook), entry.qid)
            return Defer(HOOK_FAILED_REPLY)
        if result is None:
            return _PROCEED
        if not isinstance(result, _PRE_TYPES):
            log.error("pre-delivery hook %s returned %r for %s, not Proceed, Hold, Defer, "
                      "Drop, Bounce or None", _hook_name(hook), result, entry.qid)
            return Defer(HOOK_FAILED_REPLY)
        return result

    async def run_post_delivery(self, context: PostDelivery) -> Outcome:
        """The final outcome: the hook's override, or the original outcome.

        The original stands when there is no hook, it returns None, or it fails.
        """
        hook = self.post_delivery
        if hook is None:
            return context.outcome
        try:
            result = await _call(hook, context)
        except Exception:
            log.exception("post-delivery hook %s raised for %s", _hook_name(hook),
                          context.entry.qid)
            return context.outcome
        if result is None:
            return context.outcome
        if isinstance(result, Shape):
            self.shaping.append((result, context))
            return result.outcome if isinstance(result.outcome, _POST_TYPES) else context.outcome
        if not isinstance(result, _POST_TYPES):
            log.error("post-delivery hook %s returned %r for %s, not Delivered, TempFail, "
                      "PermFail or None", _hook_name(hook), result, context.entry.qid)
            return context.outcome
        return result
