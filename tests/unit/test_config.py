"""Configuration: defaults, durations, validation errors naming the key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.config import (
    ConfigError,
    config_from_dict,
    format_duration,
    load_config,
    parse_duration,
    parse_retry_delays,
)

pytestmark = pytest.mark.unit


def test_embedded_defaults_are_the_specifications(clean_env: None, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None)
    q = cfg.queue
    assert cfg.source == "<embedded defaults>"
    assert q.maxmemoryqueue == 10000
    assert q.retry_maxtime == 72 * 3600
    assert q.retry_maxtime_reports == 24 * 3600
    assert q.retry_delays == (1800, 7200, 14400)
    assert q.quota_deferred == 10
    assert q.retry_granularity == 900
    assert q.bounces_interval == 600
    assert q.spool.partitiondepth == 2
    assert q.spool.bufsize == 8192
    assert q.store == "sqlite"
    assert q.success_sync == "flush"
    assert q.path == str(tmp_path / "var" / "queue")
    assert q.spool.rootpath == str(tmp_path / "var" / "spool")
    assert cfg.accounting.path == str(tmp_path / "var" / "log")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), (90, 90), ("90s", 90), ("30m", 1800), ("2h", 7200), ("3d", 259200),
     ("1h30m", 5400), ("1.5h", 5400), ("0", 0)],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "3x", "h", "-5", "1h-", True, None, [1]])
def test_bad_durations(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_format_duration_round_trips() -> None:
    for s in (0, 59, 60, 1800, 5400, 7200, 86400, 259200, 4000):
        assert parse_duration(format_duration(s)) == s


def test_retry_delays_pipe_string_and_list() -> None:
    assert parse_retry_delays("30m | 2h | 4h") == (1800, 7200, 14400)
    assert parse_retry_delays(["5m", 600]) == (300, 600)
    with pytest.raises(ValueError):
        parse_retry_delays("30m | | 4h")


def test_granularity_is_silently_reduced() -> None:
    cfg = config_from_dict({"queue": {"retry_delays": "10m | 1h", "retry_granularity": "1h"}})
    assert cfg.queue.retry_granularity == 300


def test_relative_paths_are_taken_from_the_config_files_directory(tmp_path: Path) -> None:
    f = tmp_path / "etc" / "sluice.yaml"
    f.parent.mkdir()
    f.write_text("queue:\n  path: q\n  spool:\n    rootpath: ../spool\n")
    cfg = load_config(f)
    assert cfg.queue.path == str(tmp_path / "etc" / "q")
    assert cfg.queue.spool.rootpath == str(tmp_path / "spool")


@pytest.mark.parametrize(("text", "journals"), [
    ("queue:\n  store: postgres\n", True),          # auto: PostgreSQL's commits cross a network
    ("queue:\n  store: sqlite\n", False),
    ("queue:\n  store: sqlite\n  success_journal: on\n", True),  # YAML's on, as written
    ("queue:\n  store: postgres\n  success_journal: off\n", False),
    ("queue:\n  store: fs\n  success_journal: true\n", True),
])
def test_the_success_journal_by_store_and_setting(tmp_path: Path, text: str,
                                                  journals: bool) -> None:
    f = tmp_path / "sluice.yaml"
    f.write_text(text)
    assert load_config(f).queue.journals_successes is journals


@pytest.mark.parametrize(
    ("text", "keypath", "fragment"),
    [
        ("queue:\n  retry_maxtime: 3x\n", "queue.retry_maxtime", "not a duration"),
        ("queue:\n  spool:\n    partitiondepth: two\n", "queue.spool.partitiondepth",
         "not of type 'integer'"),
        ("queue:\n  maxmemoryqueue: 0\n", "queue.maxmemoryqueue", "less than the minimum"),
        ("queue:\n  store: mysql\n", "queue.store", "is not one of"),
        ("queue:\n  success_journal: always\n", "queue.success_journal", "is not one of"),
        ("queue:\n  success_sync: fsync\n", "queue.success_sync", "is not one of"),
        ("queue:\n  bogus: 1\n", "queue", "unknown key"),
        ("qeueu:\n  path: x\n", "", "unknown key"),
        ("queue:\n  retry_delays: '30m | soon'\n", "queue.retry_delays", "not a duration"),
        ("smtpd:\n  listen: [1]\n", "smtpd.listen[0]", "not of type 'string'"),
        ("queue: [1, 2]\n", "queue", "not of type 'object'"),
    ],
)
def test_errors_name_the_file_and_key_path(tmp_path: Path, text: str, keypath: str,
                                            fragment: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(f)
    err = info.value
    assert err.source == str(f)
    assert err.keypath == keypath
    assert fragment in err.message
    assert str(err).startswith(str(f))
    assert "\n" not in str(err)


def test_a_key_given_twice_is_an_error_naming_both_lines(tmp_path: Path) -> None:
    f = tmp_path / "dup.yaml"
    f.write_text("queue:\n  maxmemoryqueue: 5\nbounce: {}\nqueue:\n  maxmemoryqueue: 7\n")
    with pytest.raises(ConfigError) as info:
        load_config(f)
    assert info.value.keypath == "queue"
    assert "line 4" in info.value.message and "line 1" in info.value.message
    f.write_text("delivery:\n  transport:\n    a.example: smtp:[127.0.0.1]\n"
                 "    b.example: smtp:[127.0.0.2]\n    a.example: smtp:[127.0.0.3]\n")
    with pytest.raises(ConfigError) as info:
        load_config(f)
    assert info.value.keypath == "delivery.transport.a.example"
    assert "line 5" in info.value.message and "line 3" in info.value.message
    f.write_text("smtpd:\n  mynetworks: [{a: 1, a: 2}]\n")
    with pytest.raises(ConfigError) as info:
        load_config(f)
    assert info.value.keypath == "smtpd.mynetworks[0].a"


def test_a_merge_key_may_override_and_aliases_are_fine(tmp_path: Path) -> None:
    f = tmp_path / "merge.yaml"
    f.write_text("x-base: &base {maxmemoryqueue: 5, quota_deferred: 3}\n"
                 "queue:\n  <<: *base\n  maxmemoryqueue: 7\n")
    # x-base is an unknown key: the schema refuses it, not the duplicate check.
    with pytest.raises(ConfigError) as info:
        load_config(f)
    assert "x-base" in str(info.value) and "duplicate" not in str(info.value)
    f.write_text("delivery:\n  helo: &h {'*': mx.example}\n"
                 "queue:\n  maxmemoryqueue: 7\n  <<: {quota_deferred: 3, maxmemoryqueue: 1}\n")
    cfg = load_config(f)
    assert (cfg.queue.maxmemoryqueue, cfg.queue.quota_deferred) == (7, 3)


def test_unparsable_yaml_and_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "broken.yaml"
    f.write_text("queue:\n  path: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML line"):
        load_config(f)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.yaml")
    f.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(f)


def test_sluice_config_environment_variable(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "env.yaml"
    f.write_text("queue:\n  quota_deferred: 25\n")
    monkeypatch.setenv("SLUICE_CONFIG", str(f))
    assert load_config(None).queue.quota_deferred == 25


def test_to_dict_readable_round_trips_through_validation() -> None:
    cfg = config_from_dict({"queue": {"retry_delays": "5m | 1h30m"}})
    again = config_from_dict(cfg.to_dict(readable=True))
    assert again.queue == cfg.queue


@pytest.mark.parametrize(("setting", "cores", "shared", "want"), [
    (0, 2, True, 1),    # default: a core is left to the queue manager
    (0, 8, True, 7),
    (0, 1, True, 1),    # but there is always one receiver
    (3, 2, True, 3),    # an explicit count is taken as it is
    (0, 8, False, 0),   # a store one process only may open: receive in the main process
])
def test_receiving_processes(monkeypatch: pytest.MonkeyPatch, setting: int, cores: int,
                             shared: bool, want: int) -> None:
    import os

    from sluice.smtpd import receiver_processes

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    config = config_from_dict({"smtpd": {"processes": setting}})
    assert receiver_processes(config, shared) == want


def test_tenant_shares_are_read_with_percentages_and_checked() -> None:
    from sluice.scheduler import Settings

    cfg = config_from_dict({"scheduler": {"tenants": {
        "default_weight": 2, "shares": {"acme": {"weight": 3}, "small": {"min_share": "20%"}}}}})
    shares = Settings.from_config(cfg).shares
    assert shares.weight("acme") == 3 and shares.weight("small") == 2
    assert shares.weight("other") == 2 and shares.min_shares == {"small": 0.2}
    with pytest.raises(ConfigError, match=r"x\.yaml: scheduler\.tenants\.shares: .*100 %"):
        config_from_dict({"scheduler": {"tenants": {"shares": {
            "a": {"min_share": "70%"}, "b": {"min_share": 0.5}}}}}, source="x.yaml")
    with pytest.raises(ConfigError, match=r"scheduler\.tenants\.shares\.a\.min_share"):
        config_from_dict({"scheduler": {"tenants": {"shares": {"a": {"min_share": "170%"}}}}})
    with pytest.raises(ConfigError, match=r"scheduler\.tenants\.shares\.a\.weight"):
        config_from_dict({"scheduler": {"tenants": {"shares": {"a": {"weight": 0}}}}})


def test_long_line_settings() -> None:
    cfg = config_from_dict({})
    assert cfg.delivery.smtp_line_length_limit == 998  # Postfix's default: fold
    assert cfg.smtpd.reject_long_lines is False  # accept long lines
    assert config_from_dict({"delivery": {"smtp_line_length_limit": 0}}
                            ).delivery.smtp_line_length_limit == 0
    with pytest.raises(ConfigError, match=r"x\.yaml: delivery\.smtp_line_length_limit: "
                                          r"must be 0 .* or at least 78"):
        config_from_dict({"delivery": {"smtp_line_length_limit": 10}}, source="x.yaml")


def test_a_whole_number_written_with_a_decimal_point_is_an_int() -> None:
    # JSON Schema's "integer" admits 1000.0; the compiled receiver takes ints only.
    cfg = config_from_dict({"smtpd": {"max_message_size": 1000.0, "max_recipients": 5.0}})
    assert type(cfg.smtpd.max_message_size) is int
    assert (cfg.smtpd.max_message_size, cfg.smtpd.max_recipients) == (1000, 5)
    with pytest.raises(ConfigError, match=r"smtpd\.max_message_size"):
        config_from_dict({"smtpd": {"max_message_size": 1000.5}})
