"""Operator actions as data: which entries each one touches, and what it does to them.

SUMMARY
    Action, ACTION_STATES, EFFECTS, Value, Edit, narrow(selector, action),
    check(action, priority), OperatorChange(action, now, priority,
    reply).edit(attempts) -> Edit | None

DESCRIPTION
    An operator action (``sluice hold``, the API's queue actions) is two
    rules, both defined here and nowhere else:

    which entries   ACTION_STATES: the states an action applies to;
                    entries in other states are left alone (a release
                    touches held entries only).
    what changes    EFFECTS: per action, the fields it sets and the value
                    each gets -- a fixed state, or a Value the action's
                    arguments decide (the time of the action, the
                    priority given, the bounce reply, and the one rule
                    that depends on the entry: a release returns an entry
                    never tried to incoming, one tried before to deferred).
                    DELETE has no fields: the entry leaves the queue.

    Every flavour applies the same data.  The filesystem and LevelDB
    flavours ask OperatorChange.edit() for each entry and write the Edit
    into their own record; the SQL flavours turn EFFECTS into the SET list
    of one UPDATE (sluice.store._sql), so a rule changed here changes all
    four.

INVARIANTS
    An action never touches an entry outside its ACTION_STATES.  An edit
    that sets a state takes the entry out of any manager's hands: a store
    that records owners clears the owner with it.

SEE ALSO
    sluice.store (the interface), sluice.queue.Queue.act, docs/queue.md
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sluice.model import QueueState, Reply, Selector

__all__ = [
    "ACTION_STATES",
    "BOUNCE_REPLY",
    "EFFECTS",
    "Action",
    "Edit",
    "OperatorChange",
    "Value",
    "check",
    "narrow",
]


class Action(StrEnum):
    """What an operator can do to selected entries."""

    HOLD = "hold"
    RELEASE = "release"
    RETRY = "retry"
    DELETE = "delete"
    PRIORITY = "priority"
    BOUNCE = "bounce"


#: The states each action applies to; entries in other states are left alone.
ACTION_STATES: dict[Action, tuple[QueueState, ...]] = {
    Action.HOLD: (QueueState.INCOMING, QueueState.DEFERRED, QueueState.ACTIVE,
                  QueueState.DELIVERING),
    Action.RELEASE: (QueueState.HOLD,),
    Action.RETRY: (QueueState.DEFERRED, QueueState.INCOMING),
    Action.DELETE: tuple(QueueState),
    Action.PRIORITY: tuple(QueueState),
    Action.BOUNCE: (QueueState.HOLD, QueueState.INCOMING, QueueState.DEFERRED,
                    QueueState.ACTIVE, QueueState.DELIVERING),
}

#: The reply a bounce records when the operator gives none.
BOUNCE_REPLY = Reply(550, "5.0.0", "bounced by the operator")


class Value(StrEnum):
    """A field value that the action's arguments (or the entry) decide."""

    NOW = "now"  # the time of the action
    PRIORITY = "priority"  # the priority the operator gave (0 or 1)
    REPLY = "reply"  # the operator's reply, else BOUNCE_REPLY
    INCOMING_IF_UNTRIED = "incoming-if-untried"  # incoming if attempts == 0, else deferred


#: Field -> new value, per action; None: the entry leaves the queue.  The
#: fields are QueueEntry's: state, next_attempt_at, priority, last_reply.
EFFECTS: dict[Action, Mapping[str, QueueState | Value] | None] = {
    Action.HOLD: {"state": QueueState.HOLD},
    # Never tried: back to incoming; tried before: due now.
    Action.RELEASE: {"state": Value.INCOMING_IF_UNTRIED, "next_attempt_at": Value.NOW},
    Action.RETRY: {"next_attempt_at": Value.NOW},
    Action.PRIORITY: {"priority": Value.PRIORITY},
    Action.BOUNCE: {"state": QueueState.BOUNCE, "next_attempt_at": Value.NOW,
                    "last_reply": Value.REPLY},
    Action.DELETE: None,
}


@dataclass(frozen=True, slots=True)
class Edit:
    """The new values of the fields an action changes in one entry (None: unchanged)."""

    state: QueueState | None = None
    next_attempt_at: float | None = None
    priority: int | None = None
    last_reply: Reply | None = None


def narrow(selector: Selector, action: Action) -> Selector | None:
    """The entries ``action`` would touch, for dry runs.

    ``selector`` limited to the states the action applies to; None when it
    can touch none.
    """
    states = tuple(s for s in ACTION_STATES[action]
                   if not selector.states or s in selector.states)
    if not states:
        return None
    return dataclasses.replace(selector, states=states)


def check(action: Action, priority: int | None) -> None:
    """Refuse arguments the action cannot take (ValueError)."""
    if action is Action.PRIORITY and priority not in (0, 1):
        raise ValueError("priority must be 0 or 1")


@dataclass(frozen=True, slots=True)
class OperatorChange:
    """One action with its arguments, as every flavour applies it."""

    action: Action
    now: float
    priority: int | None = None
    reply: Reply | None = None

    def __post_init__(self) -> None:
        check(self.action, self.priority)

    @property
    def states(self) -> tuple[QueueState, ...]:
        return ACTION_STATES[self.action]

    @property
    def removes(self) -> bool:
        """Whether the entries leave the queue (DELETE)."""
        return EFFECTS[self.action] is None

    def resolve(self, value: QueueState | Value) -> Any:
        """The value a field gets, for values that do not depend on the entry."""
        match value:
            case Value.NOW:
                return self.now
            case Value.PRIORITY:
                return self.priority
            case Value.REPLY:
                return self.reply or BOUNCE_REPLY
            case Value.INCOMING_IF_UNTRIED:
                raise ValueError("this value depends on the entry: use edit()")
        return value

    def edit(self, attempts: int) -> Edit | None:
        """What the action does to an entry tried ``attempts`` times (None: removed)."""
        fields = EFFECTS[self.action]
        if fields is None:
            return None
        values: dict[str, Any] = {}
        for name, value in fields.items():
            if value is Value.INCOMING_IF_UNTRIED:
                values[name] = QueueState.INCOMING if attempts == 0 else QueueState.DEFERRED
            else:
                values[name] = self.resolve(value)
        return Edit(**values)
