"""The filesystem flavour's control file names: one pattern, read two ways.

parse_name gives every field of a name, spid_of_name only its SPID (the
listing's walk sorts a million names by it).  Both must take and refuse
the same names, and a name Control.name() writes must read back.
count_names counts a whole directory by its names at once; it must give
what parse_name gives name by name.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.store import _fs_files
from sluice.store._fs_files import Name, count_names, enc_domain, parse_name, spid_of_name

pytestmark = pytest.mark.unit

HEX = "0123456789ABCDEF"

# Pieces of names, mostly well formed, with the mistakes a stray file could have.
spids = st.one_of(st.text(HEX, min_size=8, max_size=32), st.text(HEX + "abx-", max_size=34))
numbers = st.one_of(st.integers(0, 999_999).map(str), st.text("0123456789²٣+p@", max_size=8))
prios = st.sampled_from(["0", "1", "2", "01", "", "p0"])
domains = st.one_of(st.from_regex(r"[a-z0-9.-]{1,30}", fullmatch=True),
                    st.text(max_size=12))
suffixes = st.sampled_from([".mmq", ".mmq", ".mmq", ".tmp", "", ".mmq.mmq", ".MMQ"])


@given(spids, numbers, numbers, prios, domains, suffixes, st.sampled_from(["-", "_"]),
       st.sampled_from(["+", "-"]), st.sampled_from(["p", "P"]), st.sampled_from(["@", ""]))
def test_both_readers_take_and_refuse_the_same_names(spid, idx0, n, prio, domain, suffix,
                                                     dash, plus, p, at):
    name = f"{spid}{dash}{idx0}{plus}{n}{p}{prio}{at}{domain}{suffix}"
    parsed = parse_name.__wrapped__(name)
    assert spid_of_name(name) == (None if parsed is None else parsed.spid)
    if parsed is not None:
        # What was taken is what the name says, field by field (the numbers
        # by value: "00" is 0).
        assert (parsed.spid, parsed.idx0, parsed.n, parsed.priority, parsed.domain) == (
            spid, int(idx0), int(n), int(prio), domain + suffix[:-4])


@given(st.text(HEX, min_size=16, max_size=16), st.integers(0, 999_999),
       st.integers(1, 999_999), st.sampled_from([0, 1]),
       st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40))
def test_a_written_name_reads_back(spid, idx0, n, prio, domain):
    name = f"{spid}-{idx0}+{n}p{prio}@{enc_domain(domain)}.mmq"
    assert parse_name.__wrapped__(name) == Name(spid, idx0, n, prio, enc_domain(domain))
    assert spid_of_name(name) == spid


def test_digits_are_ascii_only():
    # A superscript two is a digit to str.isdigit but not to int().
    assert parse_name.__wrapped__("0123456789ABCDEF-²+1p0@x.mmq") is None
    assert spid_of_name("0123456789ABCDEF-0+1p0@x.mmq") == "0123456789ABCDEF"


# A name of a file as a directory could hold it: no "/" or NUL, under 256 bytes.
stray_names = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\0"),
                      min_size=1, max_size=40).filter(lambda n: n not in (".", ".."))
our_names = st.builds(lambda spid, idx0, n, prio, domain: f"{spid}-{idx0}+{n}p{prio}@{domain}.mmq",
                      st.text(HEX, min_size=8, max_size=32), st.integers(0, 999_999),
                      st.one_of(st.just(1), st.integers(0, 999_999)), st.sampled_from([0, 1]),
                      st.sampled_from(["a.example", "b.example", "%C3%A9.example", "x\ny",
                                       "a+1p0@b"]))
# Near misses: a leftover of a write, a name cut short.
stray_near = st.one_of(our_names.map(lambda n: n + ".tmp"), our_names.map(lambda n: n[:-4]))


@given(st.sets(st.one_of(our_names, our_names, stray_names, stray_near), max_size=30), st.data())
def test_a_directory_is_counted_as_its_names_one_by_one(names, data):
    parsed = [p for p in map(parse_name.__wrapped__, names) if p is not None]
    domain = data.draw(st.one_of(st.none(), st.sampled_from([p.domain for p in parsed] or
                                                            ["a.example"])))
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            Path(tmp, name).touch()
        n, spids = count_names(Path(tmp), domain)
    kept = [p for p in parsed if domain is None or p.domain == domain]
    assert n == sum(p.n for p in kept)
    assert sorted(s.decode() for s in spids) == sorted(p.spid for p in kept)


def test_a_directory_of_single_recipients_is_counted_in_one_pass(tmp_path, monkeypatch):
    for i in range(5):
        (tmp_path / f"0123456789ABCDE{i}-0+1p0@a.example.mmq").touch()
    (tmp_path / "0123456789ABCDEF-1+1p1@b.example.mmq").touch()
    passes = []
    patterns = _fs_files._names_of_domain

    def counted(domain, spids_only=False):
        passes.append(spids_only)
        return patterns(domain, spids_only)

    monkeypatch.setattr(_fs_files, "_names_of_domain", counted)
    n, spids = count_names(tmp_path)
    assert (n, sorted(spids)) == (6, sorted(f"0123456789ABCDE{c}".encode() for c in "01234F"))
    assert passes == [True]
    # A '+' that is not a name's own (a stray file) takes the second pass, and the same count.
    (tmp_path / "notes+1p.txt").touch()
    passes.clear()
    assert count_names(tmp_path)[0] == 6 and passes == [True, False]
    # As does a name of more than one recipient.
    (tmp_path / "0123456789ABCDEF-2+3p1@b.example.mmq").touch()
    passes.clear()
    assert count_names(tmp_path)[0] == 9 and passes == [True, False]


def test_a_missing_directory_counts_nothing(tmp_path):
    assert count_names(tmp_path / "gone") == (0, [])
    (tmp_path / "0123456789ABCDEF-0+3p0@a.example.mmq").touch()
    (tmp_path / "0123456789ABCDEF-3+2p1@b.example.mmq").touch()
    (tmp_path / "0123456789ABCDEF-5+1p0@b.example.mmq.tmp").touch()
    assert count_names(tmp_path) == (5, [b"0123456789ABCDEF"] * 2)
    assert count_names(tmp_path, "b.example") == (2, [b"0123456789ABCDEF"])
    assert os.listdir(tmp_path)  # the files are still there: counting touches nothing
