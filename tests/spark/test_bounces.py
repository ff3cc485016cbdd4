"""Bounce classification: real-world replies, and Spark agreeing with the reference."""

from __future__ import annotations

import pytest
from pyspark.sql import functions as F

from sluice.accounting import EVENT_FIELDS
from sluice.pipeline.bounces import (
    MASKED_COLUMN,
    bounce_summary,
    classify_failures,
    stored_masks,
    with_masked_reply,
)
from sluice.pipeline.rules import (
    MASK_RULES_ID,
    BounceCategory,
    classify,
    mask,
    mx_group,
    throttle_kind,
)
from sluice.pipeline.schema import (
    CLASSIFIED_SCHEMA,
    EVENT_SCHEMA,
    STORED_MASK,
    STORED_RULES,
    STORED_SCHEMA,
)
from tests.spark.frames import assert_df_equal, event, shape

pytestmark = pytest.mark.spark

C = BounceCategory

#: (event, code, enhanced, reply text, category, hard) -- texts as providers send them.
CASES = [
    ("bounced", 550, "5.1.1", "The email account that you tried to reach does not exist.",
     C.BAD_MAILBOX, True),
    ("bounced", 550, "5.1.1", "<bob@example.com>: Recipient address rejected: User unknown in "
     "virtual mailbox table", C.BAD_MAILBOX, True),
    ("bounced", 550, "5.5.0", "Requested action not taken: mailbox unavailable",
     C.BAD_MAILBOX, True),
    ("bounced", 550, "5.1.10", "RESOLVER.ADR.RecipientNotFound; Recipient not found by SMTP "
     "address lookup", C.BAD_MAILBOX, True),
    ("bounced", 556, "5.1.10", "Recipient address has null MX", C.BAD_DOMAIN, True),
    ("bounced", 550, "5.1.2", "Host or domain name not found. Name service error",
     C.BAD_DOMAIN, True),
    ("bounced", 550, "5.2.1", "The email account that you tried to reach is disabled.",
     C.INACTIVE_MAILBOX, True),
    ("bounced", 552, "5.2.2", "The email account that you tried to reach is over quota.",
     C.QUOTA_ISSUES, False),
    ("deferred", 452, "4.2.2", "The email account that you tried to reach is over quota.",
     C.QUOTA_ISSUES, False),
    ("bounced", 550, "5.7.1", "Service unavailable; Client host [192.0.2.1] blocked using "
     "zen.spamhaus.org", C.SPAM_RELATED, False),
    ("bounced", 550, "5.7.1", "Unfortunately, messages from [192.0.2.1] weren't sent. Please "
     "contact your Internet service provider since part of their network is on our block list "
     "(S3150).", C.SPAM_RELATED, False),
    ("deferred", 421, "4.7.0", "[TSS04] Messages from 192.0.2.1 temporarily deferred due to "
     "unexpected volume or user complaints", C.SPAM_RELATED, False),
    ("bounced", 554, "5.7.1", "<x@example.net>: Relay access denied", C.RELAYING_ISSUES, False),
    ("bounced", 554, "5.7.9", "Message not accepted for policy reasons.",
     C.POLICY_RELATED, False),
    ("bounced", 550, "5.7.26", "Unauthenticated email from shop.test is not accepted due to "
     "domain's DMARC policy.", C.POLICY_RELATED, False),
    ("bounced", 554, "5.6.0", "Message rejected: Virus found in attachment",
     C.VIRUS_RELATED, False),
    ("bounced", 552, "5.3.4", "Message size exceeds fixed maximum message size",
     C.CONTENT_RELATED, False),
    ("bounced", 553, "5.1.8", "<news@shop.test>: Sender address rejected: Domain not found",
     C.INVALID_SENDER, False),
    ("bounced", 500, "5.5.2", "Syntax error, command unrecognized", C.PROTOCOL_ERRORS, False),
    ("deferred", None, "4.4.1", "connect to mx.example.com[203.0.113.5]:25: Connection refused",
     C.NO_ANSWER_FROM_HOST, False),
    ("deferred", None, "4.4.2", "lost connection with mx.example.com[203.0.113.5] while "
     "sending RCPT TO", C.BAD_CONNECTION, False),
    ("deferred", 451, "4.4.0", "Temporary lookup failure", C.ROUTING_ERRORS, False),
    ("bounced", 554, "5.4.6", "Hop count exceeded - possible mail loop", C.ROUTING_ERRORS, False),
    ("bounced", 530, "5.7.0", "Must issue a STARTTLS command first", C.BAD_CONFIGURATION, False),
    ("expired", 451, "4.7.1", "Try again later", C.MESSAGE_EXPIRED, False),
    ("bounced", 554, "5.4.7", "delivery time expired", C.MESSAGE_EXPIRED, False),
    ("deferred", 451, "4.3.0", "Temporary server error. Please try again", C.OTHER, False),
    ("bounced", None, None, None, C.OTHER, False),
]


@pytest.mark.parametrize(("kind", "code", "enhanced", "text", "category", "hard"), CASES)
def test_reference_classification(kind, code, enhanced, text, category, hard):
    assert classify(kind, code, enhanced, text) == (category, hard)


@pytest.mark.parametrize("driver_keys_max", [0, 10_000], ids=["spark-rules", "driver-rules"])
def test_spark_agrees_with_the_reference(spark, driver_keys_max):
    rows = [
        event(kind, f"r{i}@example.com", i, code=code, enhanced=enhanced, response=text)
        for i, (kind, code, enhanced, text, _, _) in enumerate(CASES)
    ]
    rows.append(event("delivered", "ok@example.com", 99))
    df = spark.createDataFrame([tuple(r[f] for f in EVENT_FIELDS) for r in rows], EVENT_SCHEMA)
    classified = classify_failures(df, driver_keys_max=driver_keys_max)
    assert shape(classified.schema) == shape(CLASSIFIED_SCHEMA)
    got = {r.recipient: (r.category, r.hard, r.reason) for r in classified.collect()}
    assert "ok@example.com" not in got  # deliveries are not failures
    for i, (kind, code, enhanced, text, _, _) in enumerate(CASES):
        category, hard = classify(kind, code, enhanced, text)
        reason = " ".join(str(p) for p in (code, enhanced, mask(text) or None) if p)
        assert got[f"r{i}@example.com"] == (str(category), hard, reason), CASES[i]


def test_a_stored_mask_is_taken_only_when_the_current_rules_made_it(spark):
    rows = [
        event("bounced", f"r{i}@example.com", i, code=code, enhanced=enhanced, response=text)
        for i, (_, code, enhanced, text, _, _) in enumerate(CASES)
    ]
    rows += [event("deferred", "none@example.com", 98, response=None),
             event("delivered", "ok@example.com", 99)]
    df = spark.createDataFrame([tuple(r[f] for f in EVENT_FIELDS) for r in rows], EVENT_SCHEMA)
    stored = stored_masks(df)
    assert shape(stored.schema) == shape(EVENT_SCHEMA) + shape(STORED_SCHEMA)
    got = {r.recipient: (r[STORED_MASK], r[STORED_RULES]) for r in stored.collect()}
    for row in rows:
        want = None if row["event"] == "delivered" else mask(row["response"])
        assert got[row["recipient"]] == (want, MASK_RULES_ID), row

    def masked(rules_id: object) -> set[object]:
        forged = stored.withColumn(STORED_MASK, F.when(F.col(STORED_MASK).isNotNull(),
                                                       F.lit("forged")))
        forged = forged.withColumn(STORED_RULES, F.lit(rules_id).cast("long"))
        return {r[MASKED_COLUMN] for r in with_masked_reply(forged).collect()}

    # Made by these rules: taken as stored, nothing masked again.
    assert masked(MASK_RULES_ID) == {"forged", None}
    # Made by other rules, or by none (a file ingested before masks were
    # stored): masked again.
    again = {mask(r["response"]) for r in rows if r["event"] != "delivered"} | {None}
    assert masked(MASK_RULES_ID + 1) == again
    assert masked(None) == again


def test_summary_counts(spark):
    rows = [
        event("bounced", "a@example.com", 1, code=550, enhanced="5.1.1", response="unknown"),
        event("bounced", "A@example.com", 2, code=550, enhanced="5.1.1", response="unknown"),
        event("deferred", "b@example.com", 3, code=452, enhanced="4.2.2", response="full"),
    ]
    df = spark.createDataFrame([tuple(r[f] for f in EVENT_FIELDS) for r in rows], EVENT_SCHEMA)
    expected = spark.createDataFrame(
        [("example.com", "bounced", "bad-mailbox", True, 2, 1),
         ("example.com", "deferred", "quota-issues", False, 1, 1)],
        "domain string, event string, category string, hard boolean, count long, "
        "recipients long",
    )
    assert_df_equal(bounce_summary(classify_failures(df)), expected)


@pytest.mark.parametrize(("text", "masked"), [
    ("<bob@example.com>: user unknown", "<addr>: user unknown"),
    ("Try again at https://postmaster.example.com/421?x=1 later",
     "Try again at <url:postmaster.example.com> later"),
    # A peer named by its IP (no PTR) is one host, not two IPs.
    ("host 127.0.0.1[127.0.0.1] said: 550 5.1.1 unknown", "host <host> said: <n> <n> unknown"),
    ("connect to mx.example.com[203.0.113.5]:25: refused", "connect to <host>: refused"),
    ("conversation with mx.spamexperts.com timed out", "conversation with <host> timed out"),
    # An id of digits only is the same id as one with letters.
    ("user unknown (id 4711081542)", "user unknown (id <id>)"),
    ("user unknown (id 8F2A9C01D3)", "user unknown (id <id>)"),
    ("Client [192.0.2.44]:25123 refused, ref 4.16.55", "Client <ip> refused, ref <n>"),
    ("queued as 4Xb9Lq0Y2Wz5MkN  (id a1b2c3d4e5f6)", "queued as <id> (id <id>)"),
    ("from 2001:db8::1 blocked", "from <ip> blocked"),
    ("TSS04 limit 100 per 60s", "TSS<n> limit <n> per <n>s"),
])
def test_mask(text, masked):
    assert mask(text) == masked


def test_throttle_kinds():
    assert throttle_kind(421, "4.7.0", "Try again later, closing connection") == "rate"
    assert throttle_kind(421, "4.7.0", "Too many concurrent SMTP connections") == "connections"
    assert throttle_kind(451, "", "Connection rate limit exceeded") == "connect-rate"
    assert throttle_kind(550, "5.7.1", "rate limited") is None  # permanent: not a throttle
    assert throttle_kind(451, "4.3.0", "Temporary server error") is None


#: Replies that look like "slow down" but are about one sender or mailbox.
NOT_THROTTLES = [
    (451, "4.7.1", "Greylisted, see http://postgrey.schweikert.ch/help/example.net.html"),
    (450, "4.2.0", "<a@example.net>: Recipient address rejected: Greylisted"),
    (450, "4.2.0", "Try again later"),
    (451, "", "greylisting in action, please come back later"),
    (421, "4.7.0", "You have been grey-listed, try again later"),
    (450, "4.2.1", "The user you are trying to contact is receiving mail too quickly"),
    (452, "4.2.2", "The email account that you tried to reach is over quota"),
]


@pytest.mark.parametrize(("code", "enhanced", "text"), NOT_THROTTLES)
def test_greylisting_and_mailbox_replies_are_not_throttles(code, enhanced, text):
    assert throttle_kind(code, enhanced, text) is None


MX_HOSTS = ["gmail-smtp-in.l.google.com.", "mx1.eu.example.co.uk", "mx.example.com",
            "10.0.0.1", "[192.0.2.7]", "[IPv6:2001:db8::1]", "2001:db8::25", "localhost", None]


def test_an_ip_literal_mx_is_a_group_of_its_own():
    assert mx_group("10.0.0.1") == ("ip-10-0-0-1", ("10.0.0.1",))
    assert mx_group("[192.0.2.7]") == ("ip-192-0-2-7", ("192.0.2.7",))
    assert mx_group("[IPv6:2001:db8::1]") == ("ip-2001-db8-1", ("2001:db8::1",))


def test_spark_throttle_and_mx_group_agree_with_the_reference(spark):
    from pyspark.sql import functions as F

    from sluice.pipeline import expressions as X

    replies = [(421, "4.7.0", "Try again later, closing connection"),
               (421, "4.7.0", "Too many concurrent SMTP connections"),
               (451, "", "Connection rate limit exceeded"), *NOT_THROTTLES]
    rows = [(c, e, t, mx) for (c, e, t), mx in zip(replies * 2, MX_HOSTS * 2, strict=False)]
    df = spark.createDataFrame(rows, "code int, enhanced string, text string, mx string")
    got = df.select(X.throttle(F.col("code"), F.col("enhanced"), F.col("text")).alias("t"),
                    X.mx_group(F.col("mx")).alias("g")).collect()
    for (code, enhanced, text, mx), row in zip(rows, got, strict=True):
        kind = throttle_kind(code, enhanced or None, text)
        assert row["t"] == (None if kind is None else str(kind)), (code, enhanced, text)
        assert row["g"] == (None if mx is None else mx_group(mx)[0]), mx


def test_mx_groups():
    assert mx_group("gmail-smtp-in.l.google.com.") == (
        "gsuite", ("*.google.com", "*.googlemail.com", "*.smtp.goog"))
    assert mx_group("mx1.eu.example.co.uk")[0] == "example-co-uk"
    assert mx_group("mx.example.com") == ("example-com", ("*.example.com", "example.com"))
