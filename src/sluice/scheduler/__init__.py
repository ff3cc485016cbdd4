"""The scheduler: Halon's pickup policies and Postfix's fairness, without I/O.

SUMMARY
    Scheduler, Settings; the events and commands it speaks; Policy and
    parse_policy; explanations and views; Simulation for trying a policy.

DESCRIPTION
    Everything here is pure: standard library only, no clock, no sockets,
    no files (tests/unit/test_scheduler_purity.py keeps it so).  The
    runtime reads files and the clock and feeds this package events.

SEE ALSO
    docs/scheduler.md (the event loop), docs/policies.md (the file format)
"""

from sluice.scheduler.destinations import DEAD_REPLY
from sluice.scheduler.events import (
    ClockTicked,
    Command,
    ConditionAdded,
    ConditionRemoved,
    DeferJob,
    DeliveryFinished,
    DeliveryJob,
    EntriesClaimed,
    EntriesModified,
    Event,
    JobsQueued,
    MailArrived,
    PolicyReloaded,
    Refill,
    Route,
    StartDelivery,
    SuspensionAdded,
    SuspensionRemoved,
    Transport,
)
from sluice.scheduler.explanation import Explanation, Reason, Waiting, explain_stored
from sluice.scheduler.limits import Entry, EntryState, Limits
from sluice.scheduler.limits_grouped import GroupedLimits
from sluice.scheduler.limits_reference import ReferenceLimits
from sluice.scheduler.policy import (
    FIELDS,
    Condition,
    Counter,
    FieldSpec,
    Group,
    Pattern,
    Policy,
    PolicyError,
    Rate,
    Suspension,
    Thresholds,
)
from sluice.scheduler.policy_parse import parse_policy, parse_suspension, parse_suspensions
from sluice.scheduler.scheduler import Scheduler
from sluice.scheduler.settings import Settings
from sluice.scheduler.views import (
    CounterView,
    DestinationView,
    QueueStats,
    SubQueueView,
    SuspensionView,
)

__all__ = [
    "DEAD_REPLY",
    "FIELDS",
    "ClockTicked",
    "Command",
    "Condition",
    "ConditionAdded",
    "ConditionRemoved",
    "Counter",
    "CounterView",
    "DeferJob",
    "DeliveryFinished",
    "DeliveryJob",
    "DestinationView",
    "EntriesClaimed",
    "EntriesModified",
    "Entry",
    "EntryState",
    "Event",
    "Explanation",
    "FieldSpec",
    "Group",
    "GroupedLimits",
    "JobsQueued",
    "Limits",
    "MailArrived",
    "Pattern",
    "Policy",
    "PolicyError",
    "PolicyReloaded",
    "QueueStats",
    "Rate",
    "Reason",
    "ReferenceLimits",
    "Refill",
    "Route",
    "Scheduler",
    "Settings",
    "StartDelivery",
    "SubQueueView",
    "Suspension",
    "SuspensionAdded",
    "SuspensionRemoved",
    "SuspensionView",
    "Thresholds",
    "Transport",
    "Waiting",
    "explain_stored",
    "parse_policy",
    "parse_suspension",
    "parse_suspensions",
]
