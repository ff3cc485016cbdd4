r"""Rules: bounce categories, reason masking, throttle wording, MX groups -- as data.

SUMMARY
    BounceCategory                      PowerMTA's bounce categories
    BOUNCE_RULES, HARD_CATEGORIES       ordered rules: first match wins
    classify(event, code, enhanced, text) -> (BounceCategory, hard)
    category_of(event, enhanced, masked_text) -> BounceCategory
    mask(text) -> str                   variable parts of a reply masked
    MASK_RULES_ID                       which rules made a stored mask
    throttle_kind(code, enhanced, text) -> ThrottleKind | None
    PROVIDER_GROUPS, mx_group(host) -> (groupid, patterns)

DESCRIPTION
    This module is plain Python and imports no Spark: the same tables drive
    the Spark expressions (sluice.pipeline.bounces and friends build
    ``CASE WHEN ... RLIKE`` chains from them) and the reference functions
    here, and a test holds the two to the same answers.  Patterns are
    therefore written in the regular-expression dialect that Python's
    ``re`` and Java's ``java.util.regex`` share: classes, alternation,
    ``\b``, lookahead, ``(?i)``, possessive quantifiers (Python 3.11+).

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
import zlib
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "BOUNCE_RULES",
    "HARD_CATEGORIES",
    "MASK_MAX",
    "MASK_RULES",
    "MASK_RULES_ID",
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
    """Why a recipient failed: the categories the bounce classification assigns."""
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
    # A temporary DNS failure says nothing about the domain, whatever the
    # text around it ("Host or domain name not found ... try again").
    BounceRule(C.ROUTING_ERRORS, enhanced=r"4\.4\.3"),
    # Specific wording.
    BounceRule(C.VIRUS_RELATED, _I + r"virus|malware|infected|trojan|ransomware"),
    BounceRule(
        C.SPAM_RELATED,
        _I + r"spam|black ?list|block ?list|dnsbl|\brbl\b|spamhaus|spamcop|barracuda"
        r"|reputation|junk|unsolicited|blocked using|listed (at|in|on|by)|complaints"
        r"|banned sending ip|not accepted from this ip|ipcheck\.|permanently deferred",
    ),
    BounceRule(
        C.RELAYING_ISSUES,
        _I + r"relay(ing)? (access )?(denied|not permitted|not allowed|prohibited)"
        r"|(not permitted|unable|not allowed) to relay|we do not relay|no relaying",
    ),
    BounceRule(
        C.INVALID_SENDER,
        _I + r"sender (address )?(rejected|invalid|unknown|verify failed|domain)"
        r"|domain of sender|sender verification|invalid sender|bad sender"
        r"|sender address has null mx",
    ),
    BounceRule(C.INVALID_SENDER, enhanced=r"[45]\.1\.[78]"),
    # Rules of a recipient's own organisation (Exchange's group restrictions).
    # and a sender's own list hygiene ("excessive unknown recipients").
    BounceRule(C.POLICY_RELATED,
               _I + r"delivery restriction|notauthenticatedforgroup|excessive unknown recipients"),
    BounceRule(
        C.INACTIVE_MAILBOX,
        _I + r"inactiv(e|ity)|disabled|deactivated|discontinued"
        r"|account (has been )?(closed|suspended|expired)"
        r"|mailbox (is )?(suspended|frozen|locked)|no longer (active|available|in use)"
        r"|expired account|account (is )?(locked|terminated)",
    ),
    BounceRule(
        C.QUOTA_ISSUES,
        _I + r"quota|mailbox (is )?full|over (the )?(storage )?limit|insufficient (system )?storage"
        r"|exceeds? (the )?(storage|mailbox)|mailbox size limit|out of (disk )?(space|storage)"
        r"|storage (space|allocation)|receiving mail (too quickly|at a rate)",
    ),
    BounceRule(
        C.BAD_DOMAIN,
        _I + r"host (or domain )?(name )?not found|domain (not found|does not exist|unknown)"
        r"|no (mx|mail exchanger|such domain)|nxdomain|unknown domain|null ?mx"
        r"|(does not|doesn't) accept (e-?)?mail|unrouteable domain"
        r"|domain (is )?not (valid|configured)",
    ),
    BounceRule(
        C.BAD_MAILBOX,
        _I + r"user unknown|unknown user|no such (user|mailbox|recipient|account|address)"
        r"|(mailbox|user|recipient|address|account) (does not|doesn't|not) exist"
        r"|does not exist|invalid (recipient|mailbox|address|user)"
        r"|recipient (address |<addr> )?(not found|unknown|invalid)|recipientnotfound"
        r"|unknown (recipient|mailbox|address)"
        r"|mailbox (not found|unavailable)|not a valid (recipient|mailbox|user)"
        r"|addressee unknown|user not found|no mailbox|unrouteable address|mailbox not available"
        # Exchange Online's directory-based edge blocking: no such recipient.
        r"|recipient address rejected: access denied"
        r"|(doesn't|does not) have an? .{1,40} account|not our customer",
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
    # A session that broke after it began (RFC 3463 X.4.2) -- a timeout in
    # the middle of a conversation is not "no answer".
    BounceRule(
        C.BAD_CONNECTION,
        _I + r"lost connection|connection (reset|closed|dropped|lost)|broken pipe"
        r"|handshake (failed|failure)|unexpected (eof|end of file)|read error"
        r"|conversation with .{0,80}timed out|timed out while|timeout exceeded",
    ),
    BounceRule(
        C.NO_ANSWER_FROM_HOST,
        _I + r"connection refused|connection timed out|connect to .{0,80}timed out"
        r"|no answer|not responding|no response|host (is )?down|(host|network) (is )?unreachable"
        r"|no route to host",
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
    # X.4.1 is "no answer from host" -- a 5.4.1 came from a host that did
    # answer (Exchange Online uses it for refusals), so only 4.4.1 counts.
    BounceRule(C.NO_ANSWER_FROM_HOST, enhanced=r"4\.4\.1"),
    BounceRule(C.BAD_CONNECTION, enhanced=r"[45]\.4\.2"),
    BounceRule(C.ROUTING_ERRORS, enhanced=r"[45]\.4\.[03-6]"),
    # RFC 7372: X.7.20-X.7.29 are DKIM/SPF/DMARC failures of the sender.
    BounceRule(C.POLICY_RELATED, enhanced=r"[45]\.7\.2[0-9]"),
    # Addressing status (X.1.x) says more than broad wording such as
    # "Address rejected" (IronPort's 5.1.0).
    BounceRule(C.BAD_MAILBOX, enhanced=r"[45]\.1\.\d{1,3}"),
    # A timeout without a code or context: nobody answered.
    BounceRule(C.NO_ANSWER_FROM_HOST, _I + r"timed out|timeout"),
    # Broad wording.
    BounceRule(
        C.POLICY_RELATED,
        _I + r"policy|not (allowed|authori[sz]ed|permitted)|access denied|denied|prohibit"
        r"|rejected|blocked|refused|gr[ae]ylist|try again later|rate limit|too many"
        r"|throttl|\bspf\b|dkim|dmarc|reverse dns|\bptr\b|restrict"
        r"|concurrent (server )?connections|connection limit",
    ),
    # The code's class.
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
#: Replacements are in Java's syntax (``$1``), which Spark's
#: regexp_replace takes; mask() translates them for Python.
MASK_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # A URL keeps its host (who sent us there says something); its path
    # and query, full of addresses and ids, go.
    (r"\b(?:https?://|www\.)([^\s<>()\"'/?#:]+)[^\s<>()\"']*", "<url:$1>", ("://", "www.")),
    # Possessive runs (++, *+) here and below: a run of a class that
    # excludes what must follow it can end nowhere else, so giving back
    # characters never finds a match; both dialects then skip the futile
    # backtracking, which made these two rules most of masking's cost.
    (r"<?[^\s<>@()\[\]\";:,]++@[^\s<>@()\[\]\";:,]++>?", "<addr>", ("@",)),
    # A peer as Postfix and Sluice name it, NAME[IP]:PORT, is one token
    # (NAME is the IP itself when it has no PTR record): its name must not
    # decide the category ("host mx.spamexperts.com[...] said: 550 5.1.1
    # User unknown" is a bad mailbox).
    (r"[A-Za-z0-9_-]++(\.[A-Za-z0-9_-]++)*+\[(IPv6:)?[0-9A-Fa-f:.]++\](:\d+)?", "<host>",
     ("[",)),
    # So is a host name after the words replies put before one.
    (r"(?i)(?:(?<=\bhost )|(?<=\bwith )|(?<=\bto )|(?<=\bfrom )|(?<=\bby ))"
     r"(?:[a-z0-9_-]+\.)+[a-z][a-z0-9-]*\b\.?(:\d+)?", "<host>", (".",)),
    (r"\[?(IPv6:)?(\d{1,3}\.){3}\d{1,3}\]?(:\d+)?", "<ip>", (".",)),
    (r"(?i)\[?(IPv6:)?([0-9a-f]{1,4}:)+:([0-9a-f]{1,4}:?)*[0-9a-f]{0,4}\]?", "<ip>", ("::",)),
    (r"(?i)\[?(IPv6:)?([0-9a-f]{1,4}:){5,7}[0-9a-f]{1,4}\]?", "<ip>", (":",)),
    # Ids: tokens of eight or more characters with a digit in them, digits
    # only included ("id 8F2A9C01D3" and "id 4711081542" are one reason).
    (r"\b(?=[A-Za-z_-]*[0-9])[A-Za-z0-9_-]{8,}\b", "<id>", ()),
    (r"\d+([.,:/]\d+)*", "<n>", ()),
    (r"\s+", " ", ()),
)

#: Longest masked reason kept; the rest adds nothing to grouping.
MASK_MAX = 200

#: Which masking rules made a masked text: ingest stores it beside each
#: masked reply (sluice.pipeline.ingest), and a report uses a stored mask
#: only when it was made by the rules it would apply itself.
MASK_RULES_ID: int = zlib.crc32(repr((MASK_RULES, MASK_MAX)).encode("utf-8"))

_JAVA_GROUP = re.compile(r"\$(\d)")


def _python_replacement(java: str) -> str:
    return _JAVA_GROUP.sub(r"\\g<\1>", java)


def mask(text: str | None) -> str:
    """The reply text with its variable parts masked (reference version)."""
    out = text or ""
    for pattern, replacement, guard in MASK_RULES:
        if not guard or any(g in out for g in guard):
            out = re.sub(pattern, _python_replacement(replacement), out)
    return out.strip()[:MASK_MAX]


# --------------------------------------------------------------------------
# Throttling: replies that ask us to slow down rather than refuse the mail.

class ThrottleKind(StrEnum):
    """What a throttling reply complains of."""
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
#: Greylisting says "come back later" to a sender it does not know yet: a
#: retry passes, and it says nothing about how fast the destination takes mail.
GREYLIST_TEXT = _I + r"gr[ae]y[ -]?list"
#: RFC 3463 X.2.X: the status of one mailbox (greylisting's 4.2.0, one user
#: receiving too fast 4.2.1, over quota 4.2.2), not of the destination.
MAILBOX_STATUS = r"4\.2\.\d{1,3}"


def throttle_kind(code: int | None, enhanced: str | None, text: str | None) -> ThrottleKind | None:
    """Whether a reply is a throttle, and of which kind (reference version)."""
    if code not in THROTTLE_CODES:
        return None
    reply_text = text or ""
    status = enhanced or ""
    if _search(GREYLIST_TEXT, reply_text) or re.fullmatch(MAILBOX_STATUS, status):
        return None
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


#: An MX that is an address, not a name: 192.0.2.1, [192.0.2.1], [IPv6:2001:db8::1].
IP_LITERAL = r"^\[?(ipv6:)?([0-9]{1,3}(\.[0-9]{1,3}){3}|[0-9a-f]*:[0-9a-f:.]*)\]?$"


def ip_of_literal(name: str) -> str | None:
    """The address an IP-literal MX names (lower case), else None."""
    if not re.match(IP_LITERAL, name):
        return None
    return name.strip("[]").removeprefix("ipv6:")


def mx_group(host: str | None) -> tuple[str, tuple[str, ...]]:
    """The destination group of an MX host and its wild-card patterns.

    An address is a group of its own (``ip-192-0-2-1``, pattern the
    address itself): it has no registered domain to roll up to.
    """
    name = (host or "").lower().rstrip(".")
    ip = ip_of_literal(name)
    if ip is not None:
        return "ip-" + group_id(ip), (ip,)
    for gid, patterns in PROVIDER_GROUPS:
        if any(re.match(glob_to_regex(p), name) for p in patterns):
            return gid, patterns
    domain = registered_domain(name)
    return group_id(domain), (f"*.{domain}", domain)
