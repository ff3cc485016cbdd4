"""The pickup policy file of a running queue manager: loaded, watched, reloaded.

SUMMARY
    load_suspensions(path) -> the suspensions kept by scheduler.suspensions
    policy = PolicyFile(path, post=manager.post, running=lambda: scheduler.policy)
    policy.load() -> Policy; policy.reload(who=..., reason=...)
    await policy.watch(trouble)          (a duty of the queue manager)

DESCRIPTION
    scheduler.policy names a file in Halon's format (sluice.policyfile);
    with none, the policy is empty (no limits).  A reload reads the file
    again and hands the scheduler a PolicyReloaded event; a file that does
    not parse is logged and the running policy kept.  Reloads come from
    SIGHUP, from the watcher (every ``poll_s`` it looks at the file's
    modification time) and from the API (which records its own).  The
    first two are told to ``on_reload`` -- `sluice serve` writes them to
    the audit history with who asked and why.

SEE ALSO
    sluice.runtime.manager, sluice.policyfile, docs/policies.md
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from sluice.policyfile import load_policy_file, load_suspensions_file
from sluice.runtime.parts import Trouble
from sluice.scheduler import Event, Policy, PolicyError, PolicyReloaded, Suspension

__all__ = ["PolicyFile", "ReloadHook", "load_suspensions"]

log = logging.getLogger("sluice.manager")

#: Told of a reload a signal or the watcher asked for: (who, reason, the
#: policy before, the policy after).
ReloadHook = Callable[[str, str, Policy, Policy], None]


def load_suspensions(path: str | None) -> tuple[Suspension, ...]:
    """The suspensions added at run time (scheduler.suspensions), if any yet."""
    # The file is created by the first suspension added at run time.
    if not path or not os.path.exists(path):
        return ()
    return load_suspensions_file(path)


class PolicyFile:
    """The policy file: what it says, and a watcher that reloads it when it changes."""

    def __init__(self, path: str | None, *, post: Callable[[Event], None],
                 running: Callable[[], Policy], poll_s: float = 2.0,
                 augment: Callable[[Policy], Policy] | None = None) -> None:
        self.path = path
        self.poll_s = poll_s
        #: What the running policy adds to the file's (the shaping back-off's
        #: counters, sluice.shaping.runtime).
        self.augment = augment
        #: Called at every look at the file (the shaping rules' file is watched so).
        self.on_poll: Callable[[], None] | None = None
        self._post = post
        self._running = running
        self.on_reload: ReloadHook | None = None
        self._mtime = self._stat()

    def load(self) -> Policy:
        """The file's policy (PolicyError if it does not parse)."""
        policy = load_policy_file(self.path) if self.path else Policy()
        return policy if self.augment is None else self.augment(policy)

    def _stat(self) -> float | None:
        if not self.path:
            return None
        try:
            return os.stat(self.path).st_mtime
        except OSError:
            return None

    def reload(self, *, raise_errors: bool = False, who: str = "",
               reason: str = "") -> Policy | None:
        """Read the file again; on error keep the running policy.

        On error, returns None, or raises the PolicyError when ``raise_errors``.
        ``who`` and ``reason`` go to on_reload.
        """
        try:
            policy = self.load()
        except PolicyError as exc:
            log.error("policy not reloaded, keeping the running one:\n%s", exc)
            if raise_errors:
                raise
            return None
        before = self._running()
        self._post(PolicyReloaded(policy))
        log.info("policy reloaded from %s", self.path)
        if who and self.on_reload is not None:
            self.on_reload(who, reason, before, policy)
        return policy

    async def watch(self, trouble: Trouble) -> None:
        """Reload whenever the file's modification time changes (a duty)."""
        while True:
            await asyncio.sleep(self.poll_s)
            if self.on_poll is not None:
                self.on_poll()
            mtime = self._stat()
            trouble.ok()
            if mtime == self._mtime:
                continue
            self._mtime = mtime
            self.reload(who="policy file watcher", reason=f"{self.path} changed on disk")
