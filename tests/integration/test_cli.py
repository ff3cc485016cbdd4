"""The operator CLI as an operator runs it: real processes, real files."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, SLUICE, subprocess_env, write_config

pytestmark = pytest.mark.integration


def run(cfg: Path | None, *args: str, stdin: bytes = b"", check: bool = True
        ) -> subprocess.CompletedProcess[str]:
    cmd = [SLUICE] + (["-c", str(cfg)] if cfg else []) + list(args)
    raw = subprocess.run(cmd, input=stdin, capture_output=True, env=subprocess_env(),
                         timeout=60)  # bytes in: a message need not be UTF-8
    proc = subprocess.CompletedProcess(raw.args, raw.returncode, raw.stdout.decode(),
                                       raw.stderr.decode())
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    return write_config(tmp_path)


MSG = b"Subject: hello\n\nbody line\n"


def qlist(cfg: Path, *args: str) -> tuple[list[dict[str, str]], str]:
    out = run(cfg, "qlist", *args).stdout
    *table, totals = out.rstrip("\n").split("\n")
    rows = list(csv.DictReader(io.StringIO("\n".join(table)), delimiter=";"))
    return rows, totals


def test_sendmail_then_qlist_in_mailismus_format(cfg: Path) -> None:
    out = run(cfg, "sendmail", "-f", "alice@example.org", "bob@example.net", "c@example.com",
              "--tenant", "t1", "--job", "j9", stdin=MSG).stdout
    assert out.startswith("queued ")
    run(cfg, "sendmail", "-f", "", "postmaster@example.net", stdin=MSG)
    raw = run(cfg, "qlist").stdout.splitlines()
    assert raw[0].split(";")[0] == "QueueID" and raw[0].endswith(";DSN")
    rows, totals = qlist(cfg)
    assert len(rows) == 3
    assert [r["Recipient"] for r in rows] == ["bob@example.net", "c@example.com",
                                             "postmaster@example.net"]
    assert {r["State"] for r in rows} == {"incoming"}
    assert rows[0]["TenantID"] == "t1" and rows[0]["JobID"] == "j9"
    assert rows[2]["Sender"] == "<>"
    assert {r["DSN"] for r in rows} == {"no"}
    assert totals == "Total: 2 messages, 3 recipients; new/incoming: 3"
    assert run(cfg, "qcount").stdout.splitlines()[0] == totals


def multipart(name: str) -> bytes:
    """An ASCII header, then a 355 KB part, then a part named ``name``."""
    return ('Subject: files\nContent-Type: multipart/mixed; boundary="b"\n\n--b\n\n'
            + ("y" * 70 + "\n") * 5000
            + f'--b\nContent-Type: text/plain; name="{name}"\n\nattached\n--b--\n').encode()


def test_sendmail_flags_smtputf8_when_the_message_uses_utf8(cfg: Path, tmp_path: Path
                                                           ) -> None:
    utf8 = "Subject: Grüße\n\nbody\n".encode()
    latin1 = "Subject: Grüße\n\nbody\n".encode("latin-1")
    run(cfg, "sendmail", "-f", "a@example.org", "plain@example.net", stdin=MSG)
    run(cfg, "sendmail", "-f", "a@example.org", "subject@example.net", stdin=utf8)
    run(cfg, "sendmail", "-f", "a@example.org", "legacy@example.net", stdin=latin1)
    run(cfg, "sendmail", "-f", "a@example.org", "jürgen@exämple.net", stdin=MSG)
    run(cfg, "sendmail", "-f", "a@example.org", "--smtputf8", "asked@example.net", stdin=MSG)
    # A MIME part's header counts too; the body read for it is queued whole.
    for rcpt, name in (("attached@example.net", "Grüße.txt"), ("ascii@example.net", "a.txt")):
        run(cfg, "sendmail", "-f", "a@example.org", rcpt, stdin=multipart(name))
    entries = json.loads(run(cfg, "qlist", "--json").stdout)["entries"]
    assert {e["recipient"]: e["smtputf8"] for e in entries} == {
        "plain@example.net": False, "subject@example.net": True, "legacy@example.net": False,
        "jürgen@exämple.net": True, "asked@example.net": True,
        "attached@example.net": True, "ascii@example.net": False}
    spooled = [f.read_bytes() for f in (tmp_path / "spool").rglob("*.msg")]
    for name in ("Grüße.txt", "a.txt"):
        original = multipart(name)
        assert sum(s.endswith(original[original.index(b"\n\n"):]) for s in spooled) == 1


def test_sendmail_t_reads_recipients_and_strips_bcc(cfg: Path, tmp_path: Path) -> None:
    msg = b"To: a@x.org\nCc: B <b@y.org>\nBcc: hidden@z.org\nSubject: t\n\nbody\n"
    run(cfg, "sendmail", "-t", "-f", "s@example.org", stdin=msg)
    rows, _ = qlist(cfg)
    assert sorted(r["Recipient"] for r in rows) == ["a@x.org", "b@y.org", "hidden@z.org"]
    spool = next((tmp_path / "spool").rglob("*.msg")).read_bytes()
    assert b"Bcc" not in spool and b"hidden@z.org" not in spool
    assert b"Message-ID: <" in spool and b"Date: " in spool
    assert spool.endswith(b"\nbody\n")


def test_sendmail_without_recipients_is_misuse(cfg: Path) -> None:
    proc = run(cfg, "sendmail", stdin=MSG, check=False)
    assert proc.returncode == 2
    assert "no recipients" in proc.stderr


def test_filters_and_json(cfg: Path) -> None:
    run(cfg, "sendmail", "-f", "a@example.org", "x@gmail.com", "y@yahoo.com",
        "--tenant", "t1", stdin=MSG)
    run(cfg, "sendmail", "-f", "b@example.org", "z@gmail.com", "--tenant", "t2", "--hold",
        stdin=MSG)
    rows, totals = qlist(cfg, "--domain", "gmail.com")
    assert [r["Recipient"] for r in rows] == ["x@gmail.com", "z@gmail.com"]
    assert totals.startswith("Total: 2 messages, 2 recipients")
    rows, _ = qlist(cfg, "--state", "hold")
    assert [r["Recipient"] for r in rows] == ["z@gmail.com"]
    rows, _ = qlist(cfg, "--sender", "a@example.org", "--tenant", "t1")
    assert len(rows) == 2
    doc = json.loads(run(cfg, "qlist", "--json", "--domain", "yahoo.com").stdout)
    assert [e["recipient"] for e in doc["entries"]] == ["y@yahoo.com"]
    assert doc["totals"]["recipients"] == 1
    counts = json.loads(run(cfg, "qcount", "--json").stdout)
    assert counts["by_state"] == {"hold": 1, "incoming": 2, "deferred": 0, "active": 0,
                                  "delivering": 0, "bounce": 0}
    assert counts["messages"] == 2


def test_actions_by_id_and_selector(cfg: Path) -> None:
    run(cfg, "sendmail", "-f", "a@example.org", "x@gmail.com", "y@yahoo.com", stdin=MSG)
    rows, _ = qlist(cfg)
    gmail = next(r["QueueID"] for r in rows if r["Domain"] == "gmail.com")
    assert run(cfg, "hold", gmail).stdout.strip() == "held 1 recipient(s)"
    assert run(cfg, "hold", "--domain", "yahoo.com", "--dry-run").stdout.strip() == \
        "hold: would change 1 recipient(s)"
    assert run(cfg, "hold", "--domain", "yahoo.com").stdout.strip() == "held 1 recipient(s)"
    rows, _ = qlist(cfg)
    assert {r["State"] for r in rows} == {"hold"}
    run(cfg, "release", "--all")
    run(cfg, "priority", "1", rows[0]["SPID"])
    rows, _ = qlist(cfg)
    assert {(r["State"], r["Priority"]) for r in rows} == {("incoming", "1")}
    run(cfg, "retry", "--domain", "gmail.com")
    assert run(cfg, "delete", rows[0]["SPID"]).stdout.strip() == "deleted 2 recipient(s)"
    assert run(cfg, "qcount").stdout.startswith("Total: 0 messages, 0 recipients")


def test_queue_actions_from_the_cli_are_in_the_audit_history(cfg: Path) -> None:
    run(cfg, "sendmail", "-f", "a@example.org", "x@gmail.com", "y@yahoo.com", stdin=MSG)
    run(cfg, "hold", "--domain", "gmail.com")
    run(cfg, "hold", "--domain", "gmail.com", "--dry-run")  # changes nothing: no record
    run(cfg, "priority", "1", "--all")
    from sluice.api.audit import AuditLog, audit_path
    from sluice.config import load_config

    records, _ = AuditLog(audit_path(load_config(str(cfg)))).page(10, None)
    got = [(r.action, r.who.startswith("cli:"), r.after["count"], r.reversible)
           for r in reversed(records)]
    assert got == [("queue.hold", True, 1, False), ("queue.priority", True, 2, False)]


def test_actions_refuse_an_empty_selection_and_bad_ids(cfg: Path) -> None:
    proc = run(cfg, "delete", check=False)
    assert proc.returncode == 2 and "--all" in proc.stderr
    proc = run(cfg, "hold", "not-a-queue-id", check=False)
    assert proc.returncode == 2 and "not a queue id" in proc.stderr
    proc = run(cfg, "hold", "0123456789ABCDEF-0", check=False)
    assert proc.returncode == 2 and "no message" in proc.stderr
    assert "0123456789ABCDEF" in proc.stderr


def test_bounce_by_partial_spid_resolves_or_says_why_not(cfg: Path) -> None:
    first = run(cfg, "sendmail", "-f", "a@example.org", "x@gmail.com", stdin=MSG).stdout.split()[1]
    second = run(cfg, "sendmail", "-f", "a@example.org", "y@gmail.com", stdin=MSG).stdout.split()[1]
    # SPIDs drawn a moment apart share their leading (millisecond) digits.
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b)
    assert common >= 4
    proc = run(cfg, "bounce", first[:common], check=False)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.count("\n") == 1 and "ambiguous" in proc.stderr, proc.stderr
    proc = run(cfg, "bounce", "FFFFFFFF", check=False)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.count("\n") == 1 and "FFFFFFFF" in proc.stderr, proc.stderr
    unique = second[:common + 1].lower()
    assert run(cfg, "bounce", unique).stdout == "bounced 1 recipient(s)\n"
    rows, _ = qlist(cfg)
    assert sorted((r["Recipient"], r["DSN"]) for r in rows) == [
        ("a@example.org", "yes"), ("x@gmail.com", "no")]


def test_bounce_command_queues_an_ndr(cfg: Path) -> None:
    run(cfg, "sendmail", "-f", "alice@example.org", "x@gmail.com", stdin=MSG)
    run(cfg, "bounce", "--domain", "gmail.com")
    rows, _ = qlist(cfg)
    assert [(r["Sender"], r["Recipient"], r["DSN"]) for r in rows] == [
        ("<>", "alice@example.org", "yes")]


def test_qshape(cfg: Path) -> None:
    for rcpt in ("a@gmail.com", "b@gmail.com", "c@yahoo.com"):
        run(cfg, "sendmail", "-f", "s@example.org", rcpt, stdin=MSG)
    lines = run(cfg, "qshape").stdout.splitlines()
    assert lines[0].split() == ["T", "5", "10", "20", "40", "80", "160", "320", "640",
                                "1280", "1280+"]
    assert lines[1].split() == ["TOTAL", "3", "3"] + ["0"] * 9
    assert lines[2].split()[:3] == ["gmail.com", "2", "2"]
    assert lines[3].split()[:3] == ["yahoo.com", "1", "1"]
    assert len(run(cfg, "qshape", "--top", "1").stdout.splitlines()) == 3


def test_config_check_show_and_errors(cfg: Path, tmp_path: Path) -> None:
    assert run(cfg, "config", "check").stdout.strip() == f"{cfg}: OK"
    shown = run(cfg, "config", "show").stdout
    assert "retry_delays: 30m | 2h | 4h" in shown and "maxmemoryqueue: 10000" in shown
    bad = tmp_path / "bad.yaml"
    bad.write_text("queue:\n  spool:\n    partitiondepth: deep\n")
    for args in (("config", "check"), ("qlist",), ("sendmail", "a@b.c")):
        proc = run(bad, *args, check=False)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert lines == [f"sluice: config error: {bad}: queue.spool.partitiondepth: "
                         "'deep' is not of type 'integer'"]
        assert "Traceback" not in proc.stderr


def test_embedded_defaults_live_under_var(tmp_path: Path) -> None:
    proc = subprocess.run([SLUICE, "sendmail", "-f", "a@example.org", "b@example.net"],
                          input=MSG.decode(), capture_output=True, text=True, cwd=tmp_path,
                          env=subprocess_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "var" / "queue" / "queue.db").exists()
    assert len(list((tmp_path / "var" / "spool").rglob("*.msg"))) == 1
    assert list((tmp_path / "var" / "log").glob("sluice-acct-*.jsonl"))


def test_cli_works_while_another_process_uses_the_queue(cfg: Path) -> None:
    writer = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time\n"
            "from sluice.config import load_config\n"
            "from sluice.queue import Queue\n"
            "from sluice.model import Submission\n"
            "q = Queue.open(load_config(sys.argv[1]))\n"
            "print('open', flush=True)\n"
            "for i in range(300):\n"
            "    q.submit(Submission('w@example.org', ('r@example.net',)), b'x')\n"
            "print('done', flush=True)\n"
            "time.sleep(30)\n"), str(cfg)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, env=subprocess_env())
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "open"
        seen = []
        for _ in range(5):
            rows, _ = qlist(cfg)
            seen.append(len(rows))
            run(cfg, "hold", "--domain", "example.net")
            time.sleep(0.05)
        assert writer.stdout.readline().strip() == "done"
        rows, _ = qlist(cfg)
        assert len(rows) == 300
        assert seen == sorted(seen)
    finally:
        writer.kill()
        writer.wait()
        if writer.stdout:
            writer.stdout.close()


def test_dry_run_counts_only_what_the_action_would_touch(cfg: Path) -> None:
    run(cfg, "sendmail", "-f", "a@example.org", "x@gmail.com", "--hold", stdin=MSG)
    run(cfg, "sendmail", "-f", "a@example.org", "y@gmail.com", stdin=MSG)
    # release touches held entries only: selecting incoming ones leaves nothing
    out = run(cfg, "release", "--state", "incoming", "--dry-run").stdout.strip()
    assert out == "release: would change 0 recipient(s)"
    out = run(cfg, "release", "--domain", "gmail.com", "--dry-run").stdout.strip()
    assert out == "release: would change 1 recipient(s)"


def test_config_show_masks_secrets(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, api={"tokens": {"ops": "s3cret-token-0123456789"}},
                       smtpd={"auth": {"users": {"alice": "hunter2"}}},
                       queue={"postgres": {"dsn": "postgresql://sluice:pw123@db/sluice"}})
    shown = run(cfg, "config", "show").stdout
    for secret in ("s3cret-token-0123456789", "hunter2", "pw123"):
        assert secret not in shown
    assert "ops: '********'" in shown and "alice: '********'" in shown
    assert "postgresql://sluice:********@db/sluice" in shown


def test_qlist_lines_are_what_csv_writes_with_times_to_the_second(cfg: Path) -> None:
    # qlist writes most lines itself (csv.writer costs at a million); a
    # field with a quote, a separator or a line break still goes through
    # csv, and a cached time is the one datetime would have formatted.
    from datetime import UTC, datetime

    from sluice.config import load_config
    from sluice.model import QueueState, Reply, Submission
    from sluice.store import Transition, open_store

    t0 = 1_800_000_000.0
    store = open_store(load_config(cfg))
    try:
        plain = store.submit(Submission("a@example.org", ("p@example.net",)), b"x", t0 + 0.5)
        edge = store.submit(Submission("b@example.org", ("e@example.net",)), b"x",
                            t0 + 0.9999997)
        odd = store.submit(Submission("c@example.org", ("o@example.net", "q@example.net")),
                           b"x", t0 + 1.25)
        for e in store.claim(10, t0 + 2, 0):
            text = 'busy; try "later"\nplease' if e.spid == odd.spid else "busy"
            store.apply([Transition(e.qid, QueueState.DEFERRED, next_attempt_at=t0 + 60.9,
                                    reply=Reply(451, "4.3.0", text), attempted=True)])
    finally:
        store.close()
    out = run(cfg, "qlist").stdout
    rows, _ = qlist(cfg)
    by_qid = {r["QueueID"]: r for r in rows}

    def at(t: float) -> str:
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")

    assert by_qid[plain.qids[0]]["Arrival"] == at(t0 + 0.5)
    assert by_qid[edge.qids[0]]["Arrival"] == at(t0 + 0.9999997) == at(t0 + 1)
    assert by_qid[odd.qids[1]]["NextAttempt"] == at(t0 + 60.9)
    assert by_qid[odd.qids[1]]["LastReply"] == '451 4.3.0 busy; try "later"\nplease'
    assert by_qid[plain.qids[0]]["LastReply"] == "451 4.3.0 busy"
    # The same bytes csv.writer would write for every row.
    expected = io.StringIO()
    writer = csv.writer(expected, delimiter=";", lineterminator="\n")
    writer.writerow(rows[0].keys())
    for r in rows:
        writer.writerow(r.values())
    assert out.startswith(expected.getvalue())


def test_qcount_imports_only_the_command_modules_up_to_its_own(cfg: Path) -> None:
    # Importing every command's module cost qcount more than its own work.
    code = ("import sys\nfrom sluice.cli import main\n"
            f"status = main(['-c', {str(cfg)!r}, 'qcount'])\n"
            "print(sorted(m for m in sys.modules if m.startswith('sluice.cli.')))\n"
            "sys.exit(status)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=subprocess_env(), timeout=60, check=True).stdout
    loaded = out.strip().splitlines()[-1]
    assert "sluice.cli.queue_cmds" in loaded
    assert "sluice.cli.policy_cmds" not in loaded and "sluice.cli.serve_cmds" not in loaded
    # Everything is still there for --help and for a command that is not.
    assert "auth" in run(cfg, "--help").stdout
    bad = run(cfg, "nosuch", check=False)
    assert bad.returncode == 2 and "'auth'" in bad.stderr


def test_qlist_of_a_filesystem_queue_shares_its_files_among_processes(tmp_path: Path) -> None:
    from sluice.config import load_config
    from sluice.listing import PIECES_ALONE
    from sluice.model import Submission
    from sluice.store import open_store
    from sluice.store._fs_reading import LIST_PAGE

    cfg = write_config(tmp_path, queue={"store": "fs"})
    n = (PIECES_ALONE + 2) * LIST_PAGE  # enough pages for worker processes
    store = open_store(load_config(cfg))
    try:
        futures = [store.submit_future(Submission(f"s{i}@example.org", (f"r{i}@d{i % 7}.example",)),
                                       b"x", 1_800_000_000.0 + i / 100) for i in range(n)]
        for f in futures:
            f.result()
    finally:
        store.close()
    alone = run(cfg, "qlist", "--jobs", "1").stdout
    shared = run(cfg, "qlist", "--jobs", "2").stdout
    assert shared == alone
    lines = alone.splitlines()
    assert len(lines) == 1 + n + 1 and lines[-1].startswith(f"Total: {n} messages")
    assert [line.split(";")[4] for line in lines[1:-1]] == [f"r{i}@d{i % 7}.example"
                                                           for i in range(n)]
    bad = run(cfg, "qlist", "--jobs", "0", check=False)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().endswith("qlist --jobs: must be 1 or more, not 0")


def test_qcount_of_a_filesystem_queue_with_untrusted_totals_counts_the_names(
        tmp_path: Path) -> None:
    # With the totals untrusted (a crash cut a batch short), qcount counts the
    # names, in pieces of directories that other processes share when the count
    # is long (tests/unit/test_fs_tally.py); here the command's way there.
    from sluice.config import load_config
    from sluice.model import Submission
    from sluice.store import open_store

    cfg = write_config(tmp_path, queue={"store": "fs"})
    store = open_store(load_config(cfg))
    n = 60  # a tenant a bucket directory
    try:
        futures = [store.submit_future(
            Submission(f"s{i}@example.org", tuple(f"r{k}@d{k}.example" for k in range(i % 3 + 1)),
                       tenantid=f"t{i}"), b"x", 1_800_000_000.0 + i) for i in range(n)]
        for f in futures:
            f.result()
        counts_file = store.root / "counts"
    finally:
        store.close()
    recipients = sum(i % 3 + 1 for i in range(n))
    data = counts_file.read_bytes()
    assert b'"ok":true' in data
    counts_file.write_bytes(data.replace(b'"ok":true', b'"ok":false', 1)[:len(data) - 1] + b"\n")
    alone = run(cfg, "qcount", "--jobs", "1").stdout
    shared = run(cfg, "qcount", "--jobs", "2").stdout
    assert shared == alone
    assert alone.startswith(f"Total: {n} messages, {recipients} recipients")
    as_json = json.loads(run(cfg, "qcount", "--json", "--jobs", "2").stdout)
    assert as_json["recipients"] == recipients
    bad = run(cfg, "qcount", "--jobs", "0", check=False)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().endswith("qcount --jobs: must be 1 or more, not 0")


def test_the_sluice_package_and_its_command_line_import_no_configuration() -> None:
    # The processes qlist and qcount share their work with import the sluice
    # script again; the configuration's validator would double their start.
    code = ("import sys, sluice.cli\n"
            "print(sorted(m for m in sys.modules\n"
            "             if m.startswith(('sluice.config', 'jsonschema'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=subprocess_env(), timeout=60, check=True).stdout
    assert out.strip() == "[]"
