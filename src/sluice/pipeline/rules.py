"""Rules: bounce categories, reason masking, throttle wording, MX groups -- as data.

SUMMARY
    BounceCategory                      PowerMTA's bounce categories
    BOUNCE_RULES, HARD_CATEGORIES       ordered rules: first match wins
    classify(event, code, enhanced, text) -> (BounceCategory, hard)
    category_of(event, enhanced, masked_text) -> BounceCategory
    mask(text) -> str                   variable parts of a reply masked
    throttle_kind(code, enhanced, text) -> ThrottleKind | None
    PROVIDER_GROUPS, mx_group(host) -> (groupid, patterns)

DESCRIPTION
    This module is plain Python and imports no Spark: the same tables drive
    the Spark expressions (sluice.pipeline.bounces and friends build
    ``CASE WHEN ... RLIKE`` chains from them) and the reference functions
    here, and a test holds the two to the same answers.  Patterns are
    therefore written in the regular-expression dialect that Python's
    ``re`` and Java's ``java.util.regex`` share: classes, alternation,
    ``\\b``, lookahead, ``(?i)``.

STRATEGIES
    Masked text.  Categories are decided on the reply text after masking,
    so that addresses and URLs in a reply do not decide them, and so that
    the Spark side classifies each distinct masked reason once instead of
    every row.

    Text first, then the code.  A reply's enhanced status code (RFC 3463)
    is often generic -- most blocks come as 5.7.1 whatever the reason -- so
    specific wording ("blocked using zen.spamhaus.org", "relay access
    denied", "mailbox full") decides first, as PowerMTA's
    bounce-category-patterns do.  Then specific codes (X.1.1 bad mailbox,
    X.1.2 bad domain, X.2.1 disabled, X.2.2 full, X.4.7 expired ...), then
    broad policy wording, then the code's class (X.4 routing, X.5 protocol,
    X.6 content, X.7 policy), then "other".

    Hard means "this address will not work again": a permanent failure
    (a bounce, 5xx) in bad-mailbox, bad-domain or inactive-mailbox.  A 5xx
    for spam, policy or content says something about the message or the
    sender, not about the recipient, and is soft: suppressing recipients
    because our IP was on a block list would punish the wrong party.

    Masking turns "550 5.1.1 <bob@example.com>... user unknown (id
    8F2A9C01D3)" into "<addr>... user unknown (id <id>)", so that equal
    reasons group together: URLs, addresses, IP literals, mixed
    letter-and-digit tokens of eight or more characters, then numbers.

LIMITATIONS
    Reply texts are free-form and providers change them; the rules are a
    good default, not the truth.  "other" is the honest answer when
    nothing matches.

SEE ALSO
    RFC 3463 (enhanced status codes), RFC 7505 (null MX),
    sluice.pipeline.bounces, sluice.pipeline.shape
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "BOUNCE_RULES",
    "HARD_CATEGORIES",
    "MASK_RULES",
    "PROVIDER_GROUPS",
    "THROTTLE_CODES",
    "BounceCategory",
    "BounceRule",
    "ThrottleKind",
    "category_of",
    "classify",
    "glob_to_regex",
    "mask",
    "mx_group",
    "throttle_kind",
]


class BounceCategory(StrEnum):
    BAD_MAILBOX = "bad-mailbox"
    BAD_DOMAIN = "bad-domain"
    INACTIVE_MAILBOX = "inactive-mailbox"
    POLICY_RELATED = "policy-related"
    SPAM_RELATED = "spam-related"
    QUOTA_ISSUES = "quota-issues"
    NO_ANSWER_FROM_HOST = "no-answer-from-host"
    MESSAGE_EXPIRED = "message-expired"
    BAD_CONNECTION = "bad-connection"
    ROUTING_ERRORS = "routing-errors"
    CONTENT_RELATED = "content-related"
    PROTOCOL_ERRORS = "protocol-errors"
    RELAYING_ISSUES = "relaying-issues"
    VIRUS_RELATED = "virus-related"
    INVALID_SENDER = "invalid-sender"
    BAD_CONFIGURATION = "bad-configuration"
    OTHER = "other"


#: Categories that make a permanent failure "hard" (the address is bad).
HARD_CATEGORIES: frozenset[BounceCategory] = frozenset(
    {BounceCategory.BAD_MAILBOX, BounceCategory.BAD_DOMAIN, BounceCategory.INACTIVE_MAILBOX}
)


@dataclass(frozen=True, slots=True)
class BounceRule:
    """Matches when every given part matches; ``text`` is searched, case-blind."""

    category: BounceCategory
    text: str | None = None  # searched in the reply text
    enhanced: str | None = None  # matched against the whole enhanced code
    event: str | None = None  # the event kind must be this


C = BounceCategory
_I = "(?i)"

BOUNCE_RULES: tuple[BounceRule, ...] = (
    # Events that say it all.
    BounceRule(C.MESSAGE_EXPIRED, event="expired"),
    # Specific wording.
    BounceRule(C.VIRUS_RELATED, _I + r"virus|malware|infected|trojan|ransomware"),
    BounceRule(
        C.SPAM_RELATED,
        _I + r"spam|black ?list|block ?list|dnsbl|\brbl\b|spamhaus|spamcop|barracuda"
        r"|reputation|junk|unsolicited|blocked using|listed (at|in|on|by)|complaints",
    ),
    BounceRule(
        C.RELAYING_ISSUES,
        _I + r"relay(ing)? (access )?(denied|not permitted|not allowed|prohibited)"
        r"|(not permitted|unable|not allowed) to relay|we do not relay|no relaying",
    ),
    BounceRule(
        C.INVALID_SENDER,
        _I + r"sender (address )?(rejected|invalid|unknown|verify failed|domain)"
        r"|domain of sender|sender verification|invalid sender|bad sender",
    ),
    BounceRule(C.INVALID_SENDER, enhanced=r"[45]\.1\.[78]"),
    BounceRule(
        C.INACTIVE_MAILBOX,
        _I + r"inactive|disabled|deactivated|account (has been )?(closed|suspended|expired)"
        r"|mailbox (is )?(suspended|frozen|locked)|no longer (active|available|in use)"
        r"|expired account|account (is )?(locked|terminated)",
    ),
    BounceRule(
        C.QUOTA_ISSUES,
        _I + r"quota|mailbox (is )?full|over (the )?(storage )?limit|insufficient (system )?storage"
        r"|exceeds? (the )?(storage|mailbox)|mailbox size limit|out of (disk )?(space|storage)"
        r"|storage (space|allocation)",
    ),
    BounceRule(
        C.BAD_DOMAIN,
        _I + r"host (or domain )?(name )?not found|domain (not found|does not exist|unknown)"
        r"|no (mx|mail exchanger|such domain)|nxdomain|unknown domain|null mx"
        r"|does not accept (e-?)?mail|unrouteable domain|domain (is )?not (valid|configured)",
    ),
    BounceRule(
        C.BAD_MAILBOX,
        _I + r"user unknown|unknown user|no such (user|mailbox|recipient|account|address)"
        r"|(mailbox|user|recipient|address|account) (does not|doesn't|not) exist"
        r"|does not exist|invalid (recipient|mailbox|address|user)"
        r"|recipient (address )?(not found|unknown|invalid)|unknown (recipient|mailbox|address)"
        r"|mailbox (not found|unavailable)|not a valid (recipient|mailbox|user)"
        r"|addressee unknown|user not found|no mailbox|unrouteable address|mailbox not available",
    ),
    BounceRule(
        C.CONTENT_RELATED,
        _I + r"content|message (size )?(exceeds|too (big|large))|size limit|too large"
        r"|attachment|phish|(url|link)s? (is |are )?(not allowed|blocked|rejected)",
    ),
    BounceRule(
        C.PROTOCOL_ERRORS,
        _I + r"syntax error|command (not )?(recognized|unrecognized|implemented)|bad sequence"
        r"|protocol error|line too long|unrecognized command|bare (lf|linefeed|newline)",
    ),
    BounceRule(
        C.BAD_CONFIGURATION,
        _I + r"misconfigur|configuration error|tls (is )?required|must issue a starttls"
        r"|starttls (is )?required|encryption required|certificate|authentication required",
    ),
    BounceRule(
        C.NO_ANSWER_FROM_HOST,
        _I + r"timed out|timeout|no answer|not responding|no response|connection refused"
        r"|host (is )?down|(host|network) (is )?unreachable|no route to host",
    ),
    BounceRule(
        C.BAD_CONNECTION,
        _I + r"lost connection|connection (reset|closed|dropped|lost)|broken pipe"
        r"|handshake (failed|failure)|unexpected (eof|end of file)",
    ),
    BounceRule(
        C.MESSAGE_EXPIRED,
        _I + r"expired|too long in (the )?queue|maximum (queue )?(time|lifetime)"
        r"|retry time(out)? exceeded",
    ),
    BounceRule(
        C.ROUTING_ERRORS,
        _I + r"routing|unable to route|mail loop|loops back|mx (record|lookup)"
        r"|dns (error|failure|lookup)|lookup failure|no valid (mx|hosts)",
    ),
    # Specific codes (RFC 3463).
    BounceRule(C.BAD_MAILBOX, enhanced=r"[45]\.1\.[13-6]"),
    BounceRule(C.BAD_DOMAIN, enhanced=r"[45]\.1\.(2|10)"),
    BounceRule(C.INACTIVE_MAILBOX, enhanced=r"5\.2\.1"),
    BounceRule(C.QUOTA_ISSUES, enhanced=r"[45]\.2\.2|[45]\.3\.1"),
    BounceRule(C.CONTENT_RELATED, enhanced=r"[45]\.2\.3|[45]\.3\.4|[45]\.6\.\d{1,3}"),
    BounceRule(C.BAD_CONFIGURATION, enhanced=r"[45]\.3\.5|[45]\.7\.1[01]"),
    BounceRule(C.MESSAGE_EXPIRED, enhanced=r"[45]\.4\.7"),
    BounceRule(C.NO_ANSWER_FROM_HOST, enhanced=r"[45]\.4\.1"),
    BounceRule(C.BAD_CONNECTION, enhanced=r"[45]\.4\.2"),
    BounceRule(C.ROUTING_ERRORS, enhanced=r"[45]\.4\.[03-6]"),
    # RFC 7372: X.7.20-X.7.29 are DKIM/SPF/DMARC failures of the sender.
    BounceRule(C.POLICY_RELATED, enhanced=r"[45]\.7\.2[0-9]"),
    # Broad wording.
    BounceRule(
        C.POLICY_RELATED,
        _I + r"policy|not (allowed|authori[sz]ed|permitted)|access denied|denied|prohibited"
        r"|rejected|blocked|refused|gr[ae]ylist|try again later|rate limit|too many"
        r"|throttl|\bspf\b|dkim|dmarc|reverse dns|\bptr\b",
    ),
    # The code's class.
    BounceRule(C.BAD_MAILBOX, enhanced=r"[45]\.1\.\d{1,3}"),
    BounceRule(C.ROUTING_ERRORS, enhanced=r"[45]\.4\.\d{1,3}"),
    BounceRule(C.PROTOCOL_ERRORS, enhanced=r"[45]\.5\.\d{1,3}"),
    BounceRule(C.POLICY_RELATED, enhanced=r"[45]\.7\.\d{1,3}"),
)

#: Events the bounce classification applies to.
FAILURE_EVENTS: tuple[str, ...] = ("deferred", "bounced", "expired")


def _search(pattern: str, text: str) -> bool:
    return re.search(pattern, text) is not None


def classify(
    event: str, code: int | None, enhanced: str | None, text: str | None
) -> tuple[BounceCategory, bool]:
    """The category of a failure and whether it is hard (reference version).

    The rules see the masked text (see mask()): an address or a URL in a
    reply never decides its category ("<spam.lover@example.com>: user
    unknown" is a bad mailbox), and equal reasons get equal categories.
    """
    category = category_of(event, enhanced, mask(text))
    hard = event == "bounced" and category in HARD_CATEGORIES
    return category, hard


def category_of(event: str, enhanced: str | None, masked_text: str) -> BounceCategory:
    """The first matching rule's category for an already masked reply text."""
    status = enhanced or ""
    for rule in BOUNCE_RULES:
        if rule.event is not None and rule.event != event:
            continue
        if rule.enhanced is not None and re.fullmatch(rule.enhanced, status) is None:
            continue
        if rule.text is not None and not _search(rule.text, masked_text):
            continue
        return rule.category
    return BounceCategory.OTHER


# --------------------------------------------------------------------------
# Masking.

#: (pattern, replacement, guard), applied in order.  A rule with a guard
#: runs only on texts that contain one of the guard's strings -- which any
#: match needs anyway -- so most texts skip the costly patterns.
MASK_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (r"\b(https?://|www\.)[^\s<>()\"']+", "<url>", ("://", "www.")),
    (r"<?[^\s<>@()\[\]\";:,]+@[^\s<>@()\[\]\";:,]+>?", "<addr>", ("@",)),
    (r"\[?(IPv6:)?(\d{1,3}\.){3}\d{1,3}\]?(:\d+)?", "<ip>", (".",)),
    (r"(?i)\[?(IPv6:)?([0-9a-f]{1,4}:)+:([0-9a-f]{1,4}:?)*[0-9a-f]{0,4}\]?", "<ip>", ("::",)),
    (r"(?i)\[?(IPv6:)?([0-9a-f]{1,4}:){5,7}[0-9a-f]{1,4}\]?", "<ip>", (":",)),
    (r"\b(?=[A-Za-z_-]*[0-9])(?=[0-9_-]*[A-Za-z])[A-Za-z0-9_-]{8,}\b", "<id>", ()),
    (r"\d+([.,:/]\d+)*", "<n>", ()),
    (r"\s+", " ", ()),
)

#: Longest masked reason kept; the rest adds nothing to grouping.
MASK_MAX = 200


def mask(text: str | None) -> str:
    """The reply text with its variable parts masked (reference version)."""
    out = text or ""
    for pattern, replacement, guard in MASK_RULES:
        if not guard or any(g in out for g in guard):
            out = re.sub(pattern, replacement, out)
    return out.strip()[:MASK_MAX]


# --------------------------------------------------------------------------
# Throttling: replies that ask us to slow down rather than refuse the mail.

class ThrottleKind(StrEnum):
    RATE = "rate"  # too many messages per time unit
    CONNECTIONS = "connections"  # too many connections at once
    CONNECT_RATE = "connect-rate"  # new connections too often


#: SMTP codes that throttling replies use (RFC 5321 421, 450, 451, 452).
THROTTLE_CODES: tuple[int, ...] = (421, 450, 451, 452)

THROTTLE_TEXT = (
    _I + r"rate|too many|throttl|try (again )?later|slow down|limit|exceeded|too fast"
    r"|temporarily deferred|resources temporarily|concurrent|simultaneous"
)
CONNECTIONS_TEXT = _I + r"too many (concurrent |simultaneous |open )?(connections|sessions)" \
    r"|concurrent|simultaneous|connection limit"
CONNECT_RATE_TEXT = _I + r"connection rate|connections per|too many connections in|too fast"


def throttle_kind(code: int | None, enhanced: str | None, text: str | None) -> ThrottleKind | None:
    """Whether a reply is a throttle, and of which kind (reference version)."""
    if code not in THROTTLE_CODES:
        return None
    reply_text = text or ""
    status = enhanced or ""
    if not (re.fullmatch(r"4\.7\.\d{1,3}", status) or _search(THROTTLE_TEXT, reply_text)):
        return None
    if _search(CONNECT_RATE_TEXT, reply_text):
        return ThrottleKind.CONNECT_RATE
    if _search(CONNECTIONS_TEXT, reply_text):
        return ThrottleKind.CONNECTIONS
    return ThrottleKind.RATE


# --------------------------------------------------------------------------
# Destination groups: MX hosts of one provider count as one destination.

#: (group id, Halon wild-card patterns), checked in order.
PROVIDER_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gsuite", ("*.google.com", "*.googlemail.com", "*.smtp.goog")),
    ("o365", ("*.protection.outlook.com", "*.outlook.com", "*.hotmail.com")),
    ("yahoo", ("*.yahoodns.net", "*.yahoo.com")),
    ("icloud", ("*.mail.icloud.com", "*.me.com")),
    ("mimecast", ("*.mimecast.com",)),
    ("proofpoint", ("*.pphosted.com", "*.ppe-hosted.com")),
    ("barracuda", ("*.barracudanetworks.com",)),
)

# Second-level labels under which registrations happen (example.co.uk).
SECOND_LEVEL = ("co", "com", "net", "org", "ac", "gov", "edu", "ne", "or")


def glob_to_regex(pattern: str) -> str:
    """A Halon wild-card ('*.google.com') as an anchored, case-blind regex."""
    return "(?i)^" + re.escape(pattern).replace(r"\*", ".*") + "$"


def registered_domain(host: str) -> str:
    """example.com for mx1.eu.example.com; example.co.uk for mx.example.co.uk."""
    labels = [label for label in host.lower().rstrip(".").split(".") if label]
    if len(labels) <= 2:
        return ".".join(labels)
    if len(labels[-1]) == 2 and labels[-2] in SECOND_LEVEL:
        return ".".join(labels[-3:])
    return ".".join(labels[-2:])


def group_id(domain: str) -> str:
    """A group id from a domain: example.co.uk -> example-co-uk."""
    return re.sub(r"[^a-z0-9]+", "-", domain.lower()).strip("-") or "unknown"


def mx_group(host: str | None) -> tuple[str, tuple[str, ...]]:
    """The destination group of an MX host and its wild-card patterns."""
    name = (host or "").lower().rstrip(".")
    for gid, patterns in PROVIDER_GROUPS:
        if any(re.match(glob_to_regex(p), name) for p in patterns):
            return gid, patterns
    domain = registered_domain(name)
    return group_id(domain), (f"*.{domain}", domain)
