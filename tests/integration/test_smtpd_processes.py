"""Receivers in their own processes: two sharing a port, failures to start, SIGTERM, a full disk."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import smtplib
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from sluice.config import load_config
from sluice.model import Selector
from sluice.queue import Queue
from sluice.smtpd import ReceiverError, ReceiverPool
from tests.conftest import write_config
from tests.integration.stores import skip_without_private_mounts
from tests.integration.test_smtpd import HOST, Raw

pytestmark = pytest.mark.integration

SMTP_SOURCE = shutil.which("smtp-source") or "/usr/sbin/smtp-source"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def test_two_processes_share_the_port_and_stop_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    cfg_path = write_config(tmp_path, smtpd={"listen": [f"{HOST}:{port}"],
                                             "max_connections_per_client": 200})
    pool = ReceiverPool(cfg_path, 2)
    try:
        assert pool.start() == [(HOST, port)]
        assert len(set(pool.pids)) == 2
        before = [cpu_ticks(pid) for pid in pool.pids]
        out = subprocess.run([SMTP_SOURCE, "-s", "20", "-m", "600", "-l", "256", "-f",
                              "s@x.test", "-t", "r@y.test", f"{HOST}:{port}"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        # Both processes took mail: each spent CPU on it (300 messages are
        # tens of ticks; an idle receiver spends none).
        spent = [cpu_ticks(pid) - t for pid, t in zip(pool.pids, before, strict=True)]
        assert min(spent) >= 3, spent
        busy = Raw(port)  # a transaction in DATA when SIGTERM comes
        busy.reply()
        busy.sendall(b"EHLO b.test\r\nMAIL FROM:<a@x.test>\r\nRCPT TO:<last@y.test>\r\nDATA\r\n")
        assert [busy.reply()[:3] for _ in range(4)] == ["250", "250", "250", "354"]
        codes: list[int | None] = []
        stopper = threading.Thread(target=lambda: codes.extend(pool.stop(grace_s=20)))
        stopper.start()
        busy.sendall(b"Subject: last\r\n\r\nstill ours\r\n.\r\n")
        assert busy.reply().startswith("250 2.0.0 Ok: queued as ")
        assert busy.reply().startswith("421 4.3.2")
        busy.close()
        stopper.join(30)
        assert codes == [0, 0]
    finally:
        if pool.pids:
            pool.stop(grace_s=5)
    with Queue.open(load_config(cfg_path)) as queue:
        entries = list(queue.store.entries(Selector()))
        assert len(entries) == 601
        for entry in entries:  # the Received header names the SPID
            with queue.store.open_content(entry.spid) as f:
                head = f.read(300)
            assert f"SMTP id {entry.spid}".encode() in head


POOL_CHILD = textwrap.dedent('''
    """Starts a pool of two from a Config (by value) and prints its children.

    argv[2]: "plain"; "high-fds", with 1,100 descriptors open first (select()
    fails above 1023); "no-stdin", with fd 0 closed, so that the pool's own
    listening socket is fd 0.
    """
    import json, os, resource, sys
    from pathlib import Path
    from sluice.config import load_config
    from sluice.smtpd import ReceiverPool

    def children():
        out = set()
        for task in Path("/proc/self/task").iterdir():
            out |= {int(p) for p in (task / "children").read_text().split()}
        return out

    held = []
    sys.path.append(Path("/nowhere"))  # not a str: the import system skips it, so must the pool
    if sys.argv[2] == "high-fds":
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < 2048 and (hard == resource.RLIM_INFINITY or hard >= 2048):
            resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
        held = [os.dup(2) for _ in range(1100)]
    elif sys.argv[2] == "no-stdin":
        os.close(0)
    pool = ReceiverPool(load_config(sys.argv[1]), 2)
    pool.start()
    try:
        print(json.dumps({"pool": pool.pids, "children": sorted(children()),
                          "alive": pool.alive(), "max_fd": max(held, default=0),
                          "comm": [Path(f"/proc/{pid}/comm").read_text().strip()
                                   for pid in pool.pids],
                          "argv": [Path(f"/proc/{pid}/cmdline").read_bytes().decode()
                                   .split("\\0") for pid in pool.pids]}))
    finally:
        codes = pool.stop(grace_s=10)
    print(json.dumps({"codes": codes, "children": sorted(children())}))
''')


@pytest.mark.parametrize("case", ["plain", "high-fds", "no-stdin"])
def test_the_pool_starts_its_receivers_and_no_other_process(tmp_path: Path, case: str) -> None:
    # multiprocessing's spawn would add its resource tracker, one more
    # process for a SIGKILL to tear down before the queue manager's
    # connections close (the pool's module doc).
    port = free_port()
    cfg_path = write_config(tmp_path, smtpd={"listen": [f"{HOST}:{port}"]})
    out = subprocess.run([sys.executable, "-W", "ignore::FutureWarning", "-c", POOL_CHILD,
                          str(cfg_path), case], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    started, stopped = (json.loads(line) for line in out.stdout.splitlines())
    assert len(set(started["pool"])) == 2
    assert started["children"] == sorted(started["pool"])
    assert started["alive"] == [True, True]
    assert started["comm"] == ["sluice-receiver"] * 2  # as ps -o comm, top and pgrep show it
    if case == "high-fds":
        assert started["max_fd"] > 1100
    for argv in started["argv"]:  # the interpreter's options go along, as with spawn
        assert "-Wignore::FutureWarning" in argv, argv
    assert stopped == {"codes": [0, 0], "children": []}


def cpu_ticks(pid: int) -> int:
    """User and system CPU time of a process, in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_a_receiver_that_cannot_start_says_why(tmp_path: Path) -> None:
    port = free_port()
    blocker = socket.socket()
    blocker.bind((HOST, port))  # no SO_REUSEPORT: nobody else may bind it
    blocker.listen()
    try:
        cfg_path = write_config(tmp_path, smtpd={"listen": [f"{HOST}:{port}"]})
        with pytest.raises(ReceiverError, match=rf"cannot listen on {HOST}:{port}: "
                                                r"Address already in use"):
            ReceiverPool(cfg_path, 2).start()
    finally:
        blocker.close()
    (tmp_path / "bad").mkdir()
    bad = write_config(tmp_path / "bad", smtpd={"listen": [f"{HOST}:{port}"],
                                                "tls": {"cert": str(tmp_path / "none.pem"),
                                                        "key": str(tmp_path / "none.key")}})
    with pytest.raises(ReceiverError, match=r"smtpd\.tls\.cert: cannot load"):
        ReceiverPool(bad, 1).start()


@pytest.mark.skipif(sys.flags.ignore_environment or sys.flags.isolated,
                    reason="the hang comes through PYTHONPATH, which -E and -I ignore")
def test_a_receiver_that_never_reads_its_start_fails_the_start_in_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start larger than a pipe holds, to a child that hangs before it reads:
    the pool's write gives up at the start's deadline, and start() says so."""
    hang = tmp_path / "hang"
    hang.mkdir()
    (hang / "sitecustomize.py").write_text("import time\ntime.sleep(600)\n")
    paths = [str(hang), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    transport = {f"d{i}.example": "smtp:[127.0.0.1]:2525" for i in range(5000)}
    cfg_path = write_config(tmp_path, smtpd={"listen": [f"{HOST}:{free_port()}"]},
                            delivery={"transport": transport})
    cfg = load_config(cfg_path)  # given as a Config, the start carries all of it
    assert len(pickle.dumps(cfg)) > 1 << 17  # twice a pipe's buffer
    with pytest.raises(ReceiverError,
                       match=r"receiver \d+ did not read its start in 2 s") as failed:
        ReceiverPool(cfg, 1, start_timeout_s=2.0).start()
    pid = int(str(failed.value).split()[1])
    with pytest.raises(ProcessLookupError):  # stopped and reaped, not left sleeping
        os.kill(pid, 0)


FULL_DISK_CHILD = textwrap.dedent('''
    """Runs in a private mount namespace with the queue on a small tmpfs."""
    import asyncio, json, os, sqlite3, subprocess, sys
    from sluice.config import config_from_dict
    from sluice.queue import Queue
    from sluice.smtpd import Receiver

    root, port, inline_max, layout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    small = os.path.join(root, "small")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", small], check=True)
    cfg = config_from_dict({
        "node": {"hostname": "mx.sluice.test"},
        "queue": {"path": small + "/queue", "spool": {"rootpath": small + "/spool",
                                                       "partitiondepth": 0,
                                                       "inline_max": inline_max,
                                                       "layout": layout}},
        "accounting": {"path": root + "/log"},
        "smtpd": {"listen": [f"127.0.0.1:{port}"]},
    })
    queue = Queue.open(cfg)
    filler = os.path.join(small, "filler")

    def fill():
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        for size in (1 << 16, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"x" * size)
            except OSError:
                pass
        os.close(fd)

    async def main():
        receiver = Receiver.from_config(cfg, queue)
        await receiver.start()
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command = line.strip()
            if command == "fill":
                await loop.run_in_executor(None, fill)
            elif command == "free":
                os.unlink(filler)
            elif command == "quit":
                break
            print(command, "done", flush=True)
        await receiver.stop()

    print("ready", flush=True)
    asyncio.run(main())
    spool = [n for n in os.listdir(small + "/spool") if n.endswith(".msg")]
    with sqlite3.connect(small + "/queue/queue.db") as db:
        (inline,) = db.execute("SELECT COUNT(*) FROM content").fetchone()
        (in_segments,) = db.execute("SELECT COUNT(*) FROM content_at").fetchone()
    print(json.dumps({"messages": queue.store.count().messages, "spool_files": len(spool),
                      "inline": inline, "in_segments": in_segments}))
    queue.close()
''')


@pytest.mark.parametrize(("inline_max", "layout"), [(65536, "segments"), (0, "files"),
                                                    (0, "segments")],
                         ids=["inline", "files", "segments"])
def test_a_full_disk_answers_451_and_queues_nothing(tmp_path: Path, inline_max: int,
                                                    layout: str) -> None:
    # The queue lives on a 2 MB tmpfs mounted in a private mount namespace of
    # a child process (we are root here and in CI); the network is shared.
    skip_without_private_mounts()
    (tmp_path / "small").mkdir()
    script = tmp_path / "child.py"
    script.write_text(FULL_DISK_CHILD)
    port = free_port()
    with subprocess.Popen(["unshare", "-m", "--propagation", "private", sys.executable,
                           str(script), str(tmp_path), str(port), str(inline_max), layout],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        stdin, stdout = child.stdin, child.stdout
        assert stdin is not None
        assert stdout is not None

        def command(text: str) -> None:
            stdin.write(text + "\n")
            stdin.flush()
            assert stdout.readline().strip() == f"{text} done"

        try:
            assert stdout.readline().strip() == "ready"
            message = b"Subject: disk\r\n\r\n" + b"0123456789abcdef" * 8 + b"\r\n" * 8
            command("fill")
            with smtplib.SMTP(HOST, port, local_hostname="c.test", timeout=20) as c:
                c.ehlo()
                c.mail("a@x.test")
                c.rcpt("b@y.test")
                code, text = c.data(message)
                assert (code, text[:5]) == (451, b"4.3.0")
                command("free")  # room again: the same client succeeds
                c.mail("a@x.test")
                c.rcpt("b@y.test")
                code, text = c.data(message)
                assert (code, text[:9]) == (250, b"2.0.0 Ok:")
            stdin.write("quit\n")
            stdin.flush()
            result = json.loads(stdout.readline())
            assert child.wait(30) == 0
        finally:
            if child.poll() is None:
                child.kill()
    # Nothing is left of the refused one, wherever content lives.
    where = "inline" if inline_max else "spool_files" if layout == "files" else "in_segments"
    assert result == {"messages": 1, "spool_files": 0, "inline": 0, "in_segments": 0,
                      where: 1}
    assert not os.path.ismount(tmp_path / "small")  # the mount stayed in its namespace
