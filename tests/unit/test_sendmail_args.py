"""The sendmail command line, read as Postfix's sendmail reads it."""

from __future__ import annotations

import pytest

from sluice.cli import CommandError
from sluice.cli.sendmail_args import parse_args


@pytest.mark.parametrize(("argv", "sender"), [
    (["-f", "a@x.org"], "a@x.org"),
    (["-fa@x.org"], "a@x.org"),
    (["-f", "<a@x.org>"], "a@x.org"),
    (["-r", "a@x.org"], "a@x.org"),
    (["-f", ""], ""),
    (["-f<>"], ""),
    ([], None),
])
def test_sender_forms(argv: list[str], sender: str | None) -> None:
    assert parse_args([*argv, "r@y.org"]).sender == sender


def test_glued_flags_and_values() -> None:
    a = parse_args(["-tioem", "-odi", "-FJoe Q", "-N", "delay,failure", "-Cfile.yaml", "b@y"])
    assert (a.from_headers, a.dot_ends, a.full_name, a.notify, a.config, a.recipients) == (
        True, False, "Joe Q", "delay,failure", "file.yaml", ["b@y"])
    # -oi after -t in one word: getopt reads -t, then -o with value "i".
    assert parse_args(["-toi"]).dot_ends is False
    assert parse_args(["x@y"]).dot_ends is True


def test_long_options_stand_anywhere_and_double_dash_ends_options() -> None:
    a = parse_args(["a@x", "--tenant", "t1", "--hold", "--priority=1", "--", "-odd@x"])
    assert (a.recipients, a.tenant, a.hold, a.priority) == (["a@x", "-odd@x"], "t1", True, 1)
    assert a.queue_fields == ["--tenant", "--priority", "--hold"]


@pytest.mark.parametrize("argv", [
    ["-Q"], ["-bd"], ["-bp"], ["-q"], ["-qRsite"], ["-X", "log"], ["-n"], ["-f"],
    ["--nope"], ["-B", "9BIT"], ["--priority", "2"], ["-bs", "r@x"], ["-bs", "-t"],
])
def test_misuse_is_exit_2(argv: list[str]) -> None:
    with pytest.raises(CommandError) as info:
        parse_args(argv)
    assert info.value.status == 2 and "\n" not in str(info.value)


def test_ignored_and_noop_options() -> None:
    a = parse_args(["-v", "-m", "-odb", "-om", "-o7", "-h", "17", "-L", "tag", "-q30m",
                    "-Am", "-G", "-U", "-x", "r@x"])
    assert a.recipients == ["r@x"] and a.mode == "m"
    assert parse_args(["-bi"]).mode == "i" and parse_args(["-I"]).mode == "i"
    assert parse_args(["-bs"]).mode == "s"
    bad = parse_args(["-N", "sometimes", "r@x"])
    assert bad.notify is None and bad.warnings == ["bad -N value 'sometimes' ignored"]
