"""The store contract, tenants' part: a refill is shared between tenants by weight.

Every flavour (the ``store``/``flavour`` fixtures of conftest.py) must hand
a tenant whose mail waits behind another tenant's backlog its weighted
share of a refill, for new mail and for due deferred mail alike.  Kept out
of test_store_contract.py only to keep that file under 600 lines.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.model import Submission
from sluice.store import Store
from tests.integration.stores import open_flavour

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0


def queue_backlogs(store: Store, delay_s: float) -> None:
    """Tenant a: 500 entries (50 messages of 10) first; tenant b: 10 after."""
    for i in range(50):
        rcpts = tuple(f"r{j}@a{i % 5}.example" for j in range(10))
        store.submit(Submission("s@a.example", rcpts, tenantid="a", delay_s=delay_s),
                     f"Subject: a{i}\r\n\r\n".encode(), T0 + i)
    for i in range(10):
        store.submit(Submission("s@b.example", (f"r@b{i}.example",), tenantid="b",
                                delay_s=delay_s), f"Subject: b{i}\r\n\r\n".encode(), T0 + 100 + i)


@pytest.mark.parametrize("delay_s", [0.0, 10.0], ids=["incoming", "deferred"])
def test_a_backlog_leaves_room_for_another_tenant(store: Store, delay_s: float) -> None:
    queue_backlogs(store, delay_s)
    claimed = store.claim(20, T0 + 1000, 10)
    by = [e.tenantid for e in claimed]
    assert by.count("b") == 10 and by.count("a") == 10
    # each tenant's own mail still comes oldest first
    b_order = [e.recipient for e in claimed if e.tenantid == "b"]
    assert b_order == [f"r@b{i}.example" for i in range(10)]
    a_spids = [e.spid for e in claimed if e.tenantid == "a"]
    assert a_spids == sorted(a_spids)
    assert len({e.qid for e in claimed}) == 20


@pytest.mark.parametrize("delay_s", [0.0, 10.0], ids=["incoming", "deferred"])
def test_weights_three_to_one_split_the_refill(flavour: str, tmp_path: Path,
                                               delay_s: float) -> None:
    store = open_flavour(flavour, tmp_path,
                         scheduler={"tenants": {"shares": {"a": {"weight": 3}}}})
    try:
        queue_backlogs(store, delay_s)
        by = [e.tenantid for e in store.claim(20, T0 + 1000, 10)]
        assert by.count("a") == 15 and by.count("b") == 5
        # the next refill goes on in the same proportion
        by = [e.tenantid for e in store.claim(8, T0 + 1000, 10)]
        assert by.count("a") == 6 and by.count("b") == 2
    finally:
        store.close()


def test_not_fair_takes_the_oldest_whatever_the_tenant(flavour: str, tmp_path: Path) -> None:
    store = open_flavour(flavour, tmp_path, scheduler={"tenants": {"fair": False}})
    try:
        queue_backlogs(store, 0.0)
        assert {e.tenantid for e in store.claim(20, T0 + 1000, 10)} == {"a"}
    finally:
        store.close()


def test_kv_walks_a_bounded_window_of_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    # kv has no index by tenant: it shares what the first keys hold and reads
    # no further, so that a refill's cost does not grow with the backlog.
    from sluice.store import kv

    store = open_flavour("kv", tmp_path)
    try:
        queue_backlogs(store, 0.0)  # b's mail lies behind a's 500 keys
        monkeypatch.setattr(kv, "SCAN_MIN", 100)
        monkeypatch.setattr(kv, "SCAN_PER_PICK", 1)
        assert {e.tenantid for e in store.claim(20, T0 + 1000, 10)} == {"a"}
        monkeypatch.setattr(kv, "SCAN_MIN", 600)
        by = [e.tenantid for e in store.claim(20, T0 + 1000, 10)]
        assert by.count("b") == 10
    finally:
        store.close()
