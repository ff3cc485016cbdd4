"""Receive policy: who may hand us which mail, decided as typed SMTP replies.

SUMMARY
    Networks(cidrs).contains(ip)
    ReceivePolicy.from_config(config, suppression=None) -> ReceivePolicy
    policy.admit(open_from_client, open_total) -> Reply | None
    policy.sender(client, size) -> Reply
    policy.recipient(client, address, accepted_so_far) -> RcptVerdict
    policy.content(state) -> Reply | None

DESCRIPTION
    The SMTP adapter (sluice.smtpd.session) asks this module at each step
    of a session and sends what it answers; nothing here touches a socket,
    aiosmtpd, the clock or the queue.  Every answer is a sluice.model.Reply
    with an RFC 3463 enhanced code, so the same value serves the client,
    the log and the tests.

    Relay control.  A recipient whose domain is in ``smtpd.relay_domains``
    is accepted from anyone (we are its inbound MX).  Any other recipient
    is accepted only from a client in ``smtpd.mynetworks`` or one that
    authenticated; everyone else gets 554 5.7.1 at RCPT TO.  A relay
    domain ``example.com`` matches that domain only; ``.example.com`` or
    ``*.example.com`` matches its subdomains.  A client not allowed to
    relay is also refused a routed local part (``x%elsewhere@local``,
    ``"x@elsewhere"@local``, ``x!elsewhere@local``): a next hop that
    honours those forms would relay for it, so they are refused unless
    ``smtpd.allow_routed_local_parts`` is set (as Postfix's
    reject_unauth_destination does).

    Limits.  Connections per client address and in all (421 4.7.0 at
    connect), message size (552 5.3.4, at MAIL FROM SIZE= and after
    DATA), recipients per message (452 4.5.3: RFC 5321 4.5.3.1.10 says to
    answer 452 and take the others in a later transaction).

    Long lines.  A text line longer than RFC 5322's 998 characters is
    accepted: applications send HTML without line breaks, Postfix and most
    MTAs take it, and refusing it bounces a sender's mail for a reason the
    sender rarely controls.  Delivery folds such lines the way Postfix
    does (delivery.smtp_line_length_limit, sluice.delivery.encoder).  With
    ``smtpd.reject_long_lines`` a line over ``smtpd.max_line_length`` is
    refused instead: 554 (RFC 5321 4.3.2 lists 554, not 500, among the
    replies to the end of DATA; 500 is for command lines) with 5.6.0, a
    problem with the content.

    Suppression.  A recipient on the suppression list is refused with
    550 5.1.1 (mode ``reject``), or accepted and left out of the queued
    message (mode ``drop``); either way the adapter writes an accounting
    line (EventKind.SUPPRESSED).

STRATEGIES
    Closed by default.  A client is trusted for relaying only by an
    explicit network or a successful AUTH; an unparsable peer address is
    an outsider.  IPv4-mapped IPv6 peers (::ffff:192.0.2.1) are matched as
    the IPv4 address they are.

    Cached membership.  mynetworks is checked once per client address and
    remembered (bounded), so a busy client costs one dict lookup.

SEE ALSO
    sluice.smtpd.session (the adapter), sluice.suppression, RFC 5321,
    RFC 3463, RFC 1870 (SIZE), docs/smtpd.md
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from sluice.config import Config, ConfigError
from sluice.model import Reply, recipient_domain
from sluice.suppression import SuppressionEntry, SuppressionList, SuppressionMode

__all__ = [
    "CONTENT_LINE_TOO_LONG",
    "LIMIT_CLIENT",
    "LIMIT_TOTAL",
    "NO_VALID_RECIPIENTS",
    "QUEUE_FAILED",
    "RCPT_OK",
    "RELAY_DENIED",
    "SENDER_OK",
    "SHUTTING_DOWN",
    "TIMED_OUT",
    "TOO_MANY_RECIPIENTS",
    "Client",
    "ContentState",
    "Networks",
    "RcptAction",
    "RcptVerdict",
    "ReceivePolicy",
    "size_exceeded",
]

SENDER_OK = Reply(250, "2.1.0", "Sender ok")
RCPT_OK = Reply(250, "2.1.5", "Recipient ok")
LIMIT_CLIENT = Reply(421, "4.7.0", "Too many connections from your address, try again later")
LIMIT_TOTAL = Reply(421, "4.7.0", "Too many connections, try again later")
TIMED_OUT = Reply(421, "4.4.2", "Timeout exceeded, closing connection")
SHUTTING_DOWN = Reply(421, "4.3.2", "Service shutting down, try again later")
TOO_MANY_RECIPIENTS = Reply(452, "4.5.3", "Too many recipients")
RELAY_DENIED = Reply(554, "5.7.1", "Relay access denied")
NO_VALID_RECIPIENTS = Reply(554, "5.5.1", "No valid recipients")
#: The store could not make the message durable (full disk, I/O error).
QUEUE_FAILED = Reply(451, "4.3.0", "Queue write failed, try again later")
CONTENT_LINE_TOO_LONG = Reply(554, "5.6.0", "Message has a line longer than {limit} octets")
_NO_DOMAIN = Reply(550, "5.1.3", "Recipient address needs a domain")


def size_exceeded(limit: int) -> Reply:
    """RFC 1870's reply when a message is or announces itself too big."""
    return Reply(552, "5.3.4", f"Message size exceeds fixed limit of {limit} bytes")


class RcptAction(Enum):
    """What the adapter does with a recipient."""

    ACCEPT = "accept"  # 250, queued
    REFUSE = "refuse"  # the reply is an error, not queued
    DROP = "drop"  # 250, but left out of the queued message (suppressed)


@dataclass(frozen=True, slots=True)
class RcptVerdict:
    """The answer to one RCPT TO; ``suppressed`` names the list entry, if any."""

    action: RcptAction
    reply: Reply
    suppressed: SuppressionEntry | None = None

    def __init__(self, action: RcptAction, reply: Reply,
                 suppressed: SuppressionEntry | None = None) -> None:
        object.__setattr__(self, "action", action)
        object.__setattr__(self, "reply", reply)
        object.__setattr__(self, "suppressed", suppressed)


class ContentState(Enum):
    """How the message text measured up once DATA ended."""

    OK = "ok"
    TOO_BIG = "too_big"
    LINE_TOO_LONG = "line_too_long"
    FAILED = "failed"  # keeping the text failed (spilling to disk)


@dataclass(frozen=True, slots=True)
class Client:
    """The peer of one session as the policy sees it."""

    ip: str
    trusted: bool = False  # in mynetworks
    auth_user: str | None = None

    def __init__(self, ip: str, trusted: bool = False, auth_user: str | None = None) -> None:
        object.__setattr__(self, "ip", ip)
        object.__setattr__(self, "trusted", trusted)
        object.__setattr__(self, "auth_user", auth_user)

    @property
    def may_relay(self) -> bool:
        """Whether the client may send to any domain: trusted by network, or authenticated."""
        return self.trusted or self.auth_user is not None


def normalise_ip(text: str) -> str:
    """'::ffff:192.0.2.1' -> '192.0.2.1'; other addresses in their short form.

    An unparsable string is returned unchanged (it then matches no network).
    """
    if ":" not in text:
        return text  # IPv4 from the kernel is already in its canonical form
    try:
        addr = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return text
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


class Networks:
    """A set of CIDR blocks (IPv4 and IPv6) with a bounded membership cache."""

    __slots__ = ("_cache", "_max_cache", "_nets")

    def __init__(self, cidrs: Iterable[str], *, max_cache: int = 65536) -> None:
        nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for cidr in cidrs:
            nets.append(ipaddress.ip_network(cidr.strip(), strict=False))  # ValueError if bad
        self._nets = tuple(nets)
        self._cache: dict[str, bool] = {}
        self._max_cache = max_cache

    def __len__(self) -> int:
        return len(self._nets)

    def contains(self, ip: str) -> bool:
        """Whether ``ip`` is in one of the blocks; a string that is no address is not."""
        hit = self._cache.get(ip)
        if hit is not None:
            return hit
        try:
            addr = ipaddress.ip_address(normalise_ip(ip))
        except ValueError:
            found = False  # not an address: an outsider, never trusted
        else:
            found = any(addr.version == net.version and addr in net for net in self._nets)
        if len(self._cache) >= self._max_cache:
            self._cache.clear()  # crude, but bounded and rare
        self._cache[ip] = found
        return found


class _Domains:
    """relay_domains: exact names, and ``.parent`` / ``*.parent`` for subdomains."""

    __slots__ = ("_exact", "_parents")

    def __init__(self, names: Iterable[str]) -> None:
        exact: set[str] = set()
        parents: list[str] = []
        for raw in names:
            name = raw.strip().lower().rstrip(".")
            if name.startswith("*."):
                parents.append(name[1:])
            elif name.startswith("."):
                parents.append(name)
            elif name:
                exact.add(name)
        self._exact = frozenset(exact)
        self._parents = tuple(parents)

    def __contains__(self, domain: object) -> bool:
        if not isinstance(domain, str) or not domain:
            return False
        return domain in self._exact or (
            bool(self._parents) and any(domain.endswith(p) for p in self._parents))


_ROUTING_CHARS = frozenset("%!@")


def routed_local_part(address: str) -> bool:
    """True if the local part carries a route (``%``, ``!`` or a quoted ``@``)."""
    local = address.rpartition("@")[0]
    return any(c in _ROUTING_CHARS for c in local)


class ReceivePolicy:
    """The receiving side's rules; see the module doc."""

    def __init__(
        self,
        *,
        mynetworks: Iterable[str] = ("127.0.0.0/8", "::1/128"),
        relay_domains: Iterable[str] = (),
        max_message_size: int = 52428800,
        max_recipients: int = 1000,
        max_line_length: int = 998,
        reject_long_lines: bool = False,
        max_connections_per_client: int = 50,
        max_connections: int = 1000,
        suppression: SuppressionList | None = None,
        suppression_mode: SuppressionMode = SuppressionMode.REJECT,
        allow_routed_local_parts: bool = False,
    ) -> None:
        if min(max_message_size, max_recipients, max_line_length,
               max_connections_per_client, max_connections) < 1:
            raise ValueError("every smtpd limit must be at least 1")
        self.mynetworks = Networks(mynetworks)
        self.relay_domains = _Domains(relay_domains)
        self.max_message_size = max_message_size
        self.max_recipients = max_recipients
        self.max_line_length = max_line_length
        self.reject_long_lines = reject_long_lines
        #: What the message buffer measures against; 0: lines are not measured.
        self.line_limit = max_line_length if reject_long_lines else 0
        self.max_connections_per_client = max_connections_per_client
        self.max_connections = max_connections
        self.suppression = suppression
        self.suppression_mode = suppression_mode
        self.allow_routed_local_parts = allow_routed_local_parts
        self.too_big = size_exceeded(max_message_size)
        self.line_too_long = Reply(CONTENT_LINE_TOO_LONG.code, CONTENT_LINE_TOO_LONG.enhanced,
                                   CONTENT_LINE_TOO_LONG.text.format(limit=max_line_length))

    @classmethod
    def from_config(cls, config: Config, suppression: SuppressionList | None = None,
                    share: int = 1) -> ReceivePolicy:
        """The policy of ``config.smtpd``; ConfigError names a bad network.

        ``share`` > 1: this is one of that many receiving processes, and the
        connection limits are split between them (rounded up).
        """
        s = config.smtpd
        for i, cidr in enumerate(s.mynetworks):
            try:
                ipaddress.ip_network(cidr.strip(), strict=False)
            except ValueError as exc:
                raise ConfigError(config.source, f"smtpd.mynetworks[{i}]", str(exc)) from None
        share = max(1, share)
        return cls(
            mynetworks=s.mynetworks,
            relay_domains=s.relay_domains,
            max_message_size=s.max_message_size,
            max_recipients=s.max_recipients,
            max_line_length=s.max_line_length,
            reject_long_lines=s.reject_long_lines,
            max_connections_per_client=-(-s.max_connections_per_client // share),
            max_connections=-(-s.max_connections // share),
            suppression=suppression,
            suppression_mode=SuppressionMode(config.suppression.mode),
            allow_routed_local_parts=s.allow_routed_local_parts,
        )

    # -- connect -------------------------------------------------------------------

    def client(self, ip: str, auth_user: str | None = None) -> Client:
        """The policy's view of a peer at ``ip``: trusted if in mynetworks."""
        return Client(ip=ip, trusted=self.mynetworks.contains(ip), auth_user=auth_user)

    def admit(self, open_from_client: int, open_total: int) -> Reply | None:
        """None to let a new connection in, or the 421 to close it with.

        The counts are the connections already open, not including this one.
        """
        if open_total >= self.max_connections:
            return LIMIT_TOTAL
        if open_from_client >= self.max_connections_per_client:
            return LIMIT_CLIENT
        return None

    # -- transaction ---------------------------------------------------------------

    def sender(self, client: Client, size: int | None) -> Reply:
        """MAIL FROM; ``size`` is the SIZE= parameter (RFC 1870) if given."""
        if size is not None and size > self.max_message_size:
            return self.too_big
        return SENDER_OK

    def recipient(self, client: Client, address: str, accepted_so_far: int) -> RcptVerdict:
        """RCPT TO; ``accepted_so_far`` counts this transaction's earlier 250s."""
        if accepted_so_far >= self.max_recipients:
            return RcptVerdict(RcptAction.REFUSE, TOO_MANY_RECIPIENTS)
        domain = recipient_domain(address)
        if not domain:
            return RcptVerdict(RcptAction.REFUSE, _NO_DOMAIN)
        if not client.may_relay and (
                domain not in self.relay_domains
                or (not self.allow_routed_local_parts and routed_local_part(address))):
            return RcptVerdict(RcptAction.REFUSE, Reply(
                RELAY_DENIED.code, RELAY_DENIED.enhanced, f"<{address}>: {RELAY_DENIED.text}"))
        if self.suppression is not None:
            entry = self.suppression.lookup(address)
            if entry is not None:
                if self.suppression_mode is SuppressionMode.DROP:
                    return RcptVerdict(RcptAction.DROP, RCPT_OK, entry)
                return RcptVerdict(RcptAction.REFUSE, entry.reply(address), entry)
        return RcptVerdict(RcptAction.ACCEPT, RCPT_OK)

    def content(self, state: ContentState) -> Reply | None:
        """After DATA: None if the text may be queued, else the refusal."""
        if state is ContentState.TOO_BIG:
            return self.too_big
        if state is ContentState.LINE_TOO_LONG:
            return self.line_too_long
        if state is ContentState.FAILED:
            return QUEUE_FAILED
        return None
