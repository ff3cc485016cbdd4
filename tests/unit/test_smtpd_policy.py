"""The receive policy and AUTH credentials as values: relay control, limits, suppression."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.config import ConfigError
from sluice.smtpd.policy import (
    LIMIT_CLIENT,
    LIMIT_TOTAL,
    QUEUE_FAILED,
    RCPT_OK,
    SENDER_OK,
    TOO_MANY_RECIPIENTS,
    ContentState,
    Networks,
    RcptAction,
    ReceivePolicy,
    normalise_ip,
)
from sluice.suppression import SuppressionEntry, SuppressionList, SuppressionMode
from tests.conftest import make_config

pytestmark = pytest.mark.unit


def test_networks_match_ipv4_ipv6_and_mapped_addresses() -> None:
    nets = Networks(["127.0.0.1/32", "10.0.0.0/8", "2001:db8::/32"])
    assert nets.contains("127.0.0.1")
    assert not nets.contains("127.0.0.2")
    assert nets.contains("10.200.3.4")
    assert nets.contains("2001:db8::1")
    assert not nets.contains("2001:db9::1")
    assert nets.contains("::ffff:10.1.1.1")  # IPv4-mapped IPv6 is the IPv4 address
    assert not nets.contains("::1")
    assert not nets.contains("not-an-address")
    assert not nets.contains("")


def test_networks_answer_the_same_from_the_cache() -> None:
    nets = Networks(["192.0.2.0/24"], max_cache=2)
    for _ in range(3):
        assert nets.contains("192.0.2.7")
        assert not nets.contains("198.51.100.1")
        assert not nets.contains("203.0.113.9")  # beyond max_cache: the cache resets


def test_normalise_ip() -> None:
    assert normalise_ip("::ffff:192.0.2.1") == "192.0.2.1"
    assert normalise_ip("2001:DB8:0:0::1") == "2001:db8::1"
    assert normalise_ip("fe80::1%eth0") == "fe80::1"
    assert normalise_ip("garbage") == "garbage"


def test_outsiders_may_send_to_relay_domains_only() -> None:
    policy = ReceivePolicy(mynetworks=["127.0.0.1/32"],
                           relay_domains=["inbound.test", ".sub.test", "*.star.test"])
    outsider = policy.client("127.0.0.2")
    assert not outsider.trusted
    assert not outsider.may_relay
    ok = policy.recipient(outsider, "bob@inbound.test", 0)
    assert ok.action is RcptAction.ACCEPT
    assert ok.reply == RCPT_OK
    assert policy.recipient(outsider, "bob@INBOUND.test", 0).action is RcptAction.ACCEPT
    assert policy.recipient(outsider, "bob@a.sub.test", 0).action is RcptAction.ACCEPT
    assert policy.recipient(outsider, "bob@a.b.star.test", 0).action is RcptAction.ACCEPT
    denied = policy.recipient(outsider, "bob@elsewhere.test", 0)
    assert denied.action is RcptAction.REFUSE
    assert (denied.reply.code, denied.reply.enhanced) == (554, "5.7.1")
    assert "<bob@elsewhere.test>" in denied.reply.text
    # ".sub.test" means subdomains only; "inbound.test" not its subdomains
    assert policy.recipient(outsider, "bob@sub.test", 0).action is RcptAction.REFUSE
    assert policy.recipient(outsider, "bob@x.inbound.test", 0).action is RcptAction.REFUSE
    assert policy.recipient(outsider, "postmaster", 0).reply.code == 550


def test_trusted_and_authenticated_clients_may_relay() -> None:
    policy = ReceivePolicy(mynetworks=["127.0.0.1/32", "::1/128"])
    assert policy.recipient(policy.client("127.0.0.1"), "x@any.test", 0).action \
        is RcptAction.ACCEPT
    assert policy.recipient(policy.client("::1"), "x@any.test", 0).action is RcptAction.ACCEPT
    authed = policy.client("192.0.2.1", auth_user="alice")
    assert not authed.trusted
    assert authed.may_relay
    assert policy.recipient(authed, "x@any.test", 0).action is RcptAction.ACCEPT


def test_limits_answer_with_their_codes() -> None:
    policy = ReceivePolicy(max_recipients=2, max_message_size=1000,
                           max_connections_per_client=3, max_connections=10)
    client = policy.client("127.0.0.1")
    assert policy.recipient(client, "a@b.test", 1).action is RcptAction.ACCEPT
    over = policy.recipient(client, "a@b.test", 2)
    assert over.action is RcptAction.REFUSE
    assert over.reply == TOO_MANY_RECIPIENTS
    assert (over.reply.code, over.reply.enhanced) == (452, "4.5.3")
    assert policy.sender(client, None) == SENDER_OK
    assert policy.sender(client, 1000) == SENDER_OK
    big = policy.sender(client, 1001)
    assert (big.code, big.enhanced) == (552, "5.3.4")
    assert "1000" in big.text
    assert policy.admit(2, 9) is None
    assert policy.admit(3, 5) == LIMIT_CLIENT
    assert policy.admit(0, 10) == LIMIT_TOTAL
    assert (LIMIT_CLIENT.code, LIMIT_CLIENT.enhanced) == (421, "4.7.0")


def test_content_states_map_to_replies() -> None:
    policy = ReceivePolicy(max_message_size=500, max_line_length=100)
    assert policy.content(ContentState.OK) is None
    too_big = policy.content(ContentState.TOO_BIG)
    assert too_big is not None
    assert (too_big.code, too_big.enhanced) == (552, "5.3.4")
    long_line = policy.content(ContentState.LINE_TOO_LONG)
    assert long_line is not None
    assert (long_line.code, long_line.enhanced) == (554, "5.6.0")
    assert "100 octets" in long_line.text
    assert policy.content(ContentState.FAILED) == QUEUE_FAILED
    assert (QUEUE_FAILED.code, QUEUE_FAILED.enhanced) == (451, "4.3.0")


def test_suppressed_recipients_are_refused_or_dropped() -> None:
    entries = [SuppressionEntry("bad@x.test", reason="hard", category="bad-mailbox"),
               SuppressionEntry("@gone.test", reason="manual")]
    listed = SuppressionList(entries)
    reject = ReceivePolicy(suppression=listed, suppression_mode=SuppressionMode.REJECT)
    client = reject.client("127.0.0.1")
    verdict = reject.recipient(client, "Bad@X.test", 0)
    assert verdict.action is RcptAction.REFUSE
    assert (verdict.reply.code, verdict.reply.enhanced) == (550, "5.1.1")
    assert "suppressed" in verdict.reply.text
    assert verdict.suppressed is not None
    assert verdict.suppressed.address == "bad@x.test"
    assert reject.recipient(client, "anyone@gone.test", 0).action is RcptAction.REFUSE
    assert reject.recipient(client, "good@x.test", 0).action is RcptAction.ACCEPT
    drop = ReceivePolicy(suppression=listed, suppression_mode=SuppressionMode.DROP)
    dropped = drop.recipient(client, "bad@x.test", 0)
    assert dropped.action is RcptAction.DROP
    assert dropped.reply == RCPT_OK
    # relay control comes first: a stranger learns nothing about the list
    outsider = drop.client("192.0.2.1")
    assert drop.recipient(outsider, "bad@x.test", 0).reply.code == 554


def test_from_config_splits_connection_limits_and_names_bad_networks(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, smtpd={"max_connections": 1000, "max_connections_per_client": 5},
                      suppression={"mode": "drop"})
    policy = ReceivePolicy.from_config(cfg, share=2)
    assert policy.max_connections == 500
    assert policy.max_connections_per_client == 3  # rounded up
    assert policy.suppression_mode is SuppressionMode.DROP
    bad = make_config(tmp_path, smtpd={"mynetworks": ["127.0.0.1/32", "10.0.0.0/33"]})
    with pytest.raises(ConfigError) as err:
        ReceivePolicy.from_config(bad)
    assert err.value.keypath == "smtpd.mynetworks[1]"


def test_routed_local_parts_are_refused_to_outsiders_unless_allowed() -> None:
    routed = ["x%outside.example@local.test", '"x@outside.example"@local.test',
              "x!outside.example@local.test"]
    policy = ReceivePolicy(mynetworks=["127.0.0.1/32"], relay_domains=["local.test"])
    outsider = policy.client("192.0.2.9")
    for address in routed:
        verdict = policy.recipient(outsider, address, 0)
        assert verdict.action is RcptAction.REFUSE, address
        assert (verdict.reply.code, verdict.reply.enhanced) == (554, "5.7.1")
    assert policy.recipient(outsider, "x@local.test", 0).action is RcptAction.ACCEPT
    # a client allowed to relay may route anyway
    for address in routed:
        assert policy.recipient(policy.client("127.0.0.1"), address, 0).action \
            is RcptAction.ACCEPT
    lenient = ReceivePolicy(mynetworks=["127.0.0.1/32"], relay_domains=["local.test"],
                            allow_routed_local_parts=True)
    for address in routed:
        assert lenient.recipient(lenient.client("192.0.2.9"), address, 0).action \
            is RcptAction.ACCEPT
