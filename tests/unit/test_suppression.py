"""The suppression list as the queue reads it: format, lookups, reloads, merge."""

from __future__ import annotations

import json
import os
import threading

import pytest

from sluice.suppression import (
    FORMAT,
    SuppressionEntry,
    SuppressionFileError,
    SuppressionList,
    SuppressionMode,
    SuppressionReason,
    merge_entries,
    normalise_address,
    read_suppression_file,
    write_suppression_list,
)

pytestmark = pytest.mark.unit

NOW = 1_790_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hard(address: str, last_at: float = NOW - 100) -> SuppressionEntry:
    return SuppressionEntry(address, SuppressionReason.HARD, category="bad-mailbox", code=550,
                            enhanced="5.1.1", response="user unknown", first_at=last_at,
                            last_at=last_at)


def test_write_then_read_round_trip(tmp_path):
    path = tmp_path / "list.jsonl"
    entries = [
        hard("Bob@Example.com"),
        SuppressionEntry("full@example.org", SuppressionReason.SOFT, category="quota-issues",
                         count=5, first_at=NOW - 500, last_at=NOW - 50, expires_at=NOW + 1000),
        SuppressionEntry("@spamtrap.example"),
    ]
    assert write_suppression_list(path, entries, generated_at=NOW) == 3
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"format": FORMAT, "version": 1,
                                    "generated_at": "2026-09-21T14:13:20.000Z", "entries": 3}
    header, back = read_suppression_file(path)
    assert header["entries"] == 3
    assert back == sorted(entries, key=lambda e: e.address)
    assert not list(tmp_path.glob(".*tmp"))  # no temporary file left behind


def test_lookup_normalises_and_knows_domains():
    listed = SuppressionList([hard("bob@example.com"), SuppressionEntry("@trap.example")])
    assert listed.lookup("<BOB@Example.COM.>") is not None
    assert listed.lookup("bob@example.org") is None
    entry = listed.lookup("anyone@TRAP.example")
    assert entry is not None and entry.is_domain
    assert "x@trap.example" in listed and "y@example.com" not in listed
    assert len(listed) == 2


def test_expired_entries_do_not_suppress():
    listed = SuppressionList([SuppressionEntry("a@example.com", SuppressionReason.SOFT,
                                               expires_at=NOW)])
    assert listed.lookup("a@example.com", now=NOW - 1) is not None
    assert listed.lookup("a@example.com", now=NOW) is None


def test_reply_is_550_5_1_1_and_says_why():
    reply = hard("bob@example.com", last_at=NOW).reply("Bob@Example.com")
    assert (reply.code, reply.enhanced) == (550, "5.1.1")
    assert reply.text == ("<bob@example.com>: recipient address suppressed: it bounced "
                          "permanently (bad-mailbox) on 2026-09-21")
    assert SuppressionMode("drop") is SuppressionMode.DROP


def test_missing_file_is_empty_and_appears_later(tmp_path):
    clock = Clock()
    path = tmp_path / "list.jsonl"
    listed = SuppressionList.load(path, recheck_s=1.0, clock=clock)
    assert len(listed) == 0 and listed.lookup("bob@example.com") is None
    write_suppression_list(path, [hard("bob@example.com")], generated_at=NOW)
    assert listed.lookup("bob@example.com") is None  # not rechecked yet
    clock.now = 1.0
    assert listed.lookup("bob@example.com") is not None
    assert listed.generated_at == NOW


def test_replacement_is_seen_and_a_bad_file_keeps_the_old_list(tmp_path):
    clock = Clock()
    path = tmp_path / "list.jsonl"
    write_suppression_list(path, [hard("a@example.com")])
    listed = SuppressionList.load(path, recheck_s=0.5, clock=clock)
    write_suppression_list(path, [hard("b@example.com")])
    clock.now = 1.0
    assert listed.lookup("a@example.com") is None
    assert listed.lookup("b@example.com") is not None
    path.write_text('{"format": "sluice-suppression", "version": 1}\n{"address": 42}\n')
    clock.now = 2.0
    assert listed.refresh() is False
    assert listed.lookup("b@example.com") is not None  # the old list stays in force
    assert listed.last_error is not None and "list.jsonl:2" in listed.last_error
    os.unlink(path)
    clock.now = 3.0
    assert listed.lookup("b@example.com") is None  # removed: suppression off


@pytest.mark.parametrize(("text", "message"), [
    ("not json\n", ":1: not JSON"),
    ('["a"]\n', ":1: each line must be a JSON object"),
    ('{"format": "other", "version": 1}\n', "not a sluice-suppression version 1 file"),
    ('{"address": "no-at-sign"}\n', "neither an address nor @domain"),
    ('{"address": "a@b.example", "reason": "maybe"}\n', "'reason' must be one of"),
    ('{"address": "a@b.example", "last_at": "yesterday"}\n', "not an ISO 8601 time"),
    ('{"format": "sluice-suppression", "version": 1, "entries": 2}\n{"address": "a@b.c"}\n',
     "header says 2 entries, the file has 1"),
    (b"\xff\xfe".decode("latin-1"), "not UTF-8"),
])
def test_bad_files_name_file_and_line(tmp_path, text, message):
    path = tmp_path / "list.jsonl"
    path.write_bytes(text.encode("latin-1") if "\xff" in text else text.encode())
    with pytest.raises(SuppressionFileError, match=message) as info:
        SuppressionList.load(path)
    assert str(path) in str(info.value)


def test_hand_edited_file_with_comments(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('# added by hand\n\n{"address": "<Ops@Example.com>", "reason": "manual"}\n')
    listed = SuppressionList.load(path)
    entry = listed.lookup("ops@example.com")
    assert entry is not None and entry.reason is SuppressionReason.MANUAL


def test_merge_rules():
    old = [
        hard("stays@example.com"),
        hard("cured@example.com", last_at=NOW - 100),
        SuppressionEntry("gone@example.com", SuppressionReason.SOFT, expires_at=NOW - 1),
        SuppressionEntry("ops@example.com", SuppressionReason.MANUAL),
        hard("still-hard@example.com", last_at=NOW - 300),
    ]
    new = [
        SuppressionEntry("still-hard@example.com", SuppressionReason.SOFT, first_at=NOW - 200,
                         last_at=NOW - 20),
        SuppressionEntry("ops@example.com", SuppressionReason.HARD),
        hard("fresh@example.com"),
    ]
    delivered = {"cured@example.com": NOW - 50, "stays@example.com": NOW - 1000,
                 "ops@example.com": NOW}
    merged = {e.address: e for e in merge_entries(old, new, delivered, NOW)}
    assert sorted(merged) == ["fresh@example.com", "ops@example.com", "stays@example.com",
                              "still-hard@example.com"]
    assert merged["ops@example.com"].reason is SuppressionReason.MANUAL
    still = merged["still-hard@example.com"]
    assert still.reason is SuppressionReason.HARD and still.last_at == NOW - 20


def test_lookups_during_reloads_from_another_thread(tmp_path):
    path = tmp_path / "list.jsonl"
    write_suppression_list(path, [hard("a@example.com")])
    listed = SuppressionList.load(path, recheck_s=0.0)
    stop = threading.Event()
    misses: list[str] = []

    def writer() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            write_suppression_list(path, [hard("a@example.com"), hard(f"x{n}@example.com")])

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(300):
            if listed.lookup("a@example.com") is None:
                misses.append("a")
    finally:
        stop.set()
        thread.join()
    # Atomic replacement: a reader never sees a missing or half-written list.
    assert misses == []
    assert listed.last_error is None


def test_normalise_address():
    assert normalise_address(" <Bob@Example.COM.> ") == "bob@example.com"
    with pytest.raises(ValueError, match="needs an address"):
        SuppressionEntry("  ")
