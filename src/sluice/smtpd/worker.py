"""Receiving processes: several Receivers sharing the SMTP port, one per core.

SUMMARY
    receiver_processes(config, shared_access) -> int
    pool = ReceiverPool(config_or_path, processes, sockets=None)
    pool.start() -> [(host, port), ...]     # ReceiverError if one fails
    pool.stop(grace_s=None) -> exit codes
    run_receiver_process(config_or_path, ready=None, *, share=1, sockets=None) -> int

DESCRIPTION
    One Python process accepting mail keeps one core busy; a second one
    accepting from the same listening socket uses the second core.  The
    pool's owner binds the sockets once (sluice.smtpd.server.bind_listeners,
    without SO_REUSEPORT, so the port is this pool's alone) and every
    process inherits them as file descriptors.  Each process opens
    its own Queue on the configured store, which must allow several
    processes (Store.shared_access, true for SQLite and PostgreSQL).  A
    store that does not (LevelDB) is opened by one process only: then
    ``sluice serve`` runs its Receiver in the main process instead.

    run_receiver_process is the body of one such process: it loads the
    configuration (a path, or a Config passed by value), opens the queue,
    starts a Receiver on the sockets it was given, says so on ``ready``, serves until
    SIGTERM or SIGINT, stops gracefully and closes the queue.  It uses
    uvloop when it is installed.

    ReceiverPool starts and stops a set of them as new interpreters
    (subprocess, not fork: the parent may have threads -- a store's
    committer, the scheduler -- and forking a process with threads copies
    locks in whatever state they were), with the parent's interpreter
    options.  A child reads its start on a pipe of its own: the parent's
    sys.path as one JSON line, then a pickled _Start (the configuration,
    its share, the parent's pid, the descriptors of its sockets).  It
    reports one JSON line on another pipe, ("ready", pid, addresses) or
    ("error", pid, message).  Both the parent's write of the start and
    its wait for the reports end at one deadline (start_timeout_s): a
    child that hangs before it reads cannot hold the parent for good.

STRATEGIES
    No resource tracker.  multiprocessing's spawn starts one more Python
    process beside the pool, multiprocessing's resource tracker, and a
    SIGKILL of ``sluice serve``'s process group then tears it down beside
    the queue manager on the same cores: on an idle machine the manager's
    first connection closed 5.6-7.1 ms after the kill with it, 4.0-6.0 ms
    without it (bench/kill_teardown.py, PostgreSQL).  A next hop's reply in
    that time is a delivery sent again after the restart (docs/queue.md,
    window 1), so the pool starts its processes itself.

    Die with the parent.  A receiver asks the kernel (PR_SET_PDEATHSIG) for
    SIGTERM when its parent dies, so a killed ``sluice serve`` does not
    leave receivers holding the port; they stop gracefully like on any
    SIGTERM.

    Report, don't trace.  A start that fails (bad configuration, port in
    use) sends one line naming the cause to the parent and exits 1; the
    parent raises ReceiverError with that line.  `sluice serve` checks the
    configuration (sluice.runtime.preflight) and binds the port before it
    starts any process, so what a process can still find is rare.

SEE ALSO
    sluice.smtpd.server, docs/smtpd.md
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice import _gc
from sluice._fdio import write_all, write_all_by
from sluice.config import Config, ConfigError, load_config
from sluice.logs import LOG_LEVEL_ENV, setup_logging
from sluice.queue import Queue
from sluice.smtpd.server import Receiver, ReceiverError, bind_listeners, listen_addresses
from sluice.store import StorageError

__all__ = ["ReceiverPool", "receiver_processes", "run_receiver_process"]

log = logging.getLogger("sluice.smtpd")

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15

#: A receiving process's name for ps -o comm, top and pgrep (the kernel keeps 15 bytes).
PROCESS_NAME = "sluice-receiver"


def receiver_processes(config: Config, shared_access: bool) -> int:
    """How many receiving processes to start; 0 means receive in the caller.

    ``smtpd.processes`` 0 means one per CPU core but one, which the queue
    manager in the main process needs about as much as a receiver under
    full load (on two cores, one receiver delivered 3 % more end to end
    than two, with 7 % less CPU per message: docs/smtpd.md); at least one.
    A store without shared access is never opened by several processes.
    """
    if not shared_access:
        return 0
    return config.smtpd.processes or max(1, (os.cpu_count() or 1) - 1)


def _prctl(option: int, arg: Any) -> bool:
    """Call prctl(2); False where it cannot be called (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return True


def _die_with_parent(parent_pid: int) -> None:
    if not _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _name_process(name: str) -> None:
    """Name this process (its main thread, and the threads it starts later)."""
    _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class _ReadyPipe:
    """A child's end of its report pipe: one JSON line a message."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, message: tuple[Any, ...]) -> None:
        write_all(self.fd, (json.dumps(message) + "\n").encode())


def _tell(ready: Any, message: tuple[Any, ...]) -> None:
    if ready is None:
        return
    with contextlib.suppress(OSError, ValueError):
        if hasattr(ready, "send"):
            ready.send(message)
        elif message[0] == "ready" and hasattr(ready, "set"):
            ready.set()


def _fail(ready: Any, message: str) -> None:
    """Tell the parent, which prints it once, not once per process.

    Print it here only when no parent listens.
    """
    _tell(ready, ("error", os.getpid(), message))
    if not hasattr(ready, "send"):
        print(f"sluice receiver: {message}", file=sys.stderr)


def run_receiver_process(config: Config | str | os.PathLike[str] | None = None,
                         ready: Any = None, *, share: int = 1,
                         parent_pid: int | None = None,
                         sockets: list[socket.socket] | None = None) -> int:
    """Serve SMTP in this process until SIGTERM/SIGINT; returns the exit status.

    ``ready`` has ``send``, which receives ("ready", pid, [(host, port),
    ...]) or ("error", pid, message), or is an Event-like object that is
    set once listening.  ``share`` is the number
    of receiving processes (for the connection limits).  ``sockets`` are
    listening sockets to serve on; without them ``smtpd.listen`` is bound here.
    """
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    try:
        cfg = config if isinstance(config, Config) else load_config(config)
    except ConfigError as exc:
        _fail(ready, str(exc))
        return 1
    # A spawned process starts with no logging: set it up as serve did (sluice.logs).
    setup_logging(cfg.logging, os.environ.get(LOG_LEVEL_ENV) or None, hostname=cfg.hostname)
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        return runner.run(_serve(cfg, ready, share, sockets))


async def _serve(config: Config, ready: Any, share: int,
                 sockets: list[socket.socket] | None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        queue = Queue.open(config)
    except (StorageError, OSError) as exc:
        _fail(ready, f"cannot open the queue: {exc}")
        return 1
    try:
        try:
            receiver = Receiver.from_config(config, queue, sockets=sockets, share=share)
            await receiver.start()
        except (ConfigError, ReceiverError) as exc:
            _fail(ready, str(exc))
            return 1
        _tell(ready, ("ready", os.getpid(), receiver.addresses))
        await stop.wait()
        await receiver.stop()
        return 0
    finally:
        await asyncio.to_thread(queue.close)


def _process_main(config: Config | str, ready: Any, share: int, parent_pid: int,
                  sockets: list[socket.socket]) -> None:
    # The status is the exit code.
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until the loop installs its handler
    _gc.for_serving()
    sys.exit(run_receiver_process(config, ready, share=share, parent_pid=parent_pid,
                                  sockets=sockets))


@dataclass(frozen=True, slots=True)
class _Start:
    """What a receiving process is started with (pickled on its start pipe)."""

    config: Config | str
    share: int
    parent_pid: int
    socket_fds: tuple[int, ...]


#: A child's program, run with -P (no working directory on sys.path): its
#: start pipe's first line is the parent's sys.path, so that it imports what
#: the parent did; argv holds the start pipe's and the report pipe's fds.
_CHILD = ("import json, os, sys; start = os.fdopen(int(sys.argv[1]), 'rb'); "
          "sys.path[:] = json.loads(start.readline()); "
          "from sluice.smtpd.worker import _child_main; _child_main(start, int(sys.argv[2]))")


def _child_main(start_pipe: Any, report_fd: int) -> None:
    """The body of a process ReceiverPool started: read the start, then serve."""
    _name_process(PROCESS_NAME)  # not "python" in ps and top
    with start_pipe:
        start: _Start = pickle.load(start_pipe)
    os.set_inheritable(report_fd, False)
    sockets = [socket.socket(fileno=fd) for fd in start.socket_fds]
    for sock in sockets:  # nothing the receiver runs holds the port
        sock.set_inheritable(False)
    _process_main(start.config, _ReadyPipe(report_fd), start.share, start.parent_pid, sockets)


def _interpreter_flags() -> list[str]:
    """This interpreter's options that a child shares (as multiprocessing's spawn passed them)."""
    flags = sys.flags
    out = ["-P"]
    if flags.isolated:
        out.append("-I")
    else:
        if flags.ignore_environment:
            out.append("-E")
        if flags.no_user_site:
            out.append("-s")
    if flags.dont_write_bytecode:
        out.append("-B")
    if flags.optimize:
        out.append("-" + "O" * flags.optimize)
    out += [f"-W{w}" for w in sys.warnoptions]
    out += [f"-X{k}" if v is True else f"-X{k}={v}" for k, v in sys._xoptions.items()]
    return out


def _report(pid: int, line: bytes) -> tuple[Any, ...]:
    """A child's report line as ("ready", pid, addresses) or ("error", pid, message)."""
    try:
        message = json.loads(line)
    except ValueError:
        message = None
    if (isinstance(message, list) and len(message) == 3
            and message[0] in ("ready", "error")):
        return tuple(message)
    return ("error", pid, f"receiver {pid} reported {line[:200]!r}")


class ReceiverPool:
    """A set of receiving processes sharing the SMTP port (see the module doc).

    ``sockets`` are listening sockets bound already, which the pool then
    owns (it closes its copies once the processes have theirs); without
    them start() binds ``smtpd.listen``.
    """

    def __init__(self, config: Config | str | os.PathLike[str], processes: int, *,
                 sockets: list[socket.socket] | None = None,
                 start_timeout_s: float = 60.0) -> None:
        if processes < 1:
            raise ValueError("a receiver pool needs at least one process")
        self.config: Config | str = config if isinstance(config, Config) else str(Path(config))
        self.processes = processes
        self.start_timeout_s = start_timeout_s
        self._procs: list[subprocess.Popen[bytes]] = []
        self._addresses: list[tuple[str, int]] = []
        self._sockets = sockets

    @property
    def pids(self) -> list[int]:
        """The process ids of the receiving processes started."""
        return [p.pid for p in self._procs]

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """The addresses the pool listens on."""
        return list(self._addresses)

    def alive(self) -> list[bool]:
        """Whether each receiving process is alive, in start order."""
        return [p.poll() is None for p in self._procs]

    def start(self) -> list[tuple[str, int]]:
        """Start every process and wait until each listens; ReceiverError if one fails."""
        if self._procs:
            raise RuntimeError("the pool is already started")
        sockets, self._sockets = self._sockets, None
        if sockets is None:
            cfg = self.config if isinstance(self.config, Config) else load_config(self.config)
            sockets = bind_listeners(listen_addresses(cfg), cfg.smtpd.backlog)
        reports: list[int] = []
        deadline = time.monotonic() + self.start_timeout_s
        try:
            try:
                self._start_processes(sockets, reports, deadline)
            finally:
                # Each process has its own descriptors now; the port stays
                # open while any of them listens.
                for sock in sockets:
                    sock.close()
            problem = self._wait_ready(reports, deadline)
        except BaseException:
            self.stop(grace_s=10.0)
            raise
        finally:
            for fd in reports:
                os.close(fd)
        if problem is not None:
            # The others are starting or serving: they stop at once on SIGTERM.
            self.stop(grace_s=10.0)
            raise ReceiverError(problem)
        return self.addresses

    def _start_processes(self, sockets: list[socket.socket], reports: list[int],
                         deadline: float) -> None:
        """Start the processes; each one's report pipe goes to ``reports`` at once.

        A process that has not read its start by ``deadline`` is a
        ReceiverError (start() then stops those it started).
        """
        fds = tuple(sock.fileno() for sock in sockets)
        path = [p for p in sys.path if isinstance(p, str)]  # import ignores the others
        payload = (json.dumps(path) + "\n").encode() + pickle.dumps(
            _Start(self.config, self.processes, os.getpid(), fds))
        command = [sys.executable, *_interpreter_flags(), "-c", _CHILD]
        for _ in range(self.processes):
            report_r, report_w = os.pipe()
            reports.append(report_r)
            start_r, start_w = os.pipe()
            try:
                try:
                    # No stdin redirected: a socket that is fd 0 stays fd 0.
                    proc = subprocess.Popen([*command, str(start_r), str(report_w)],
                                            pass_fds=(start_r, report_w, *fds))
                finally:
                    os.close(start_r)
                    os.close(report_w)
                self._procs.append(proc)
                # A child that died at once says so in _wait_ready (its exit status).
                with contextlib.suppress(BrokenPipeError):
                    if not write_all_by(start_w, payload, deadline):
                        # No use starting more: start() stops them all.
                        raise ReceiverError(f"receiver {proc.pid} did not read its start in "
                                            f"{self.start_timeout_s:.0f} s")
            finally:
                os.close(start_w)

    def _wait_ready(self, reports: list[int], deadline: float) -> str | None:
        """Each process's report, in order, by ``deadline``; the first problem reported, if any."""
        problem: str | None = None
        for proc, pipe in zip(self._procs, reports, strict=True):
            message = self._wait_message(proc, pipe, deadline)
            if message[0] == "ready":
                for addr in message[2]:
                    if tuple(addr) not in self._addresses:
                        self._addresses.append((str(addr[0]), int(addr[1])))
            elif problem is None:
                problem = str(message[2])
        return problem

    def _wait_message(self, proc: subprocess.Popen[bytes], pipe: int, deadline: float
                      ) -> tuple[Any, ...]:
        data = b""
        poller = select.poll()  # not select(): a descriptor may be above 1023
        poller.register(pipe, select.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return ("error", proc.pid, f"receiver {proc.pid} did not start in "
                        f"{self.start_timeout_s:.0f} s")
            if poller.poll(min(left, 0.2) * 1000):
                chunk = os.read(pipe, 65536)
                data += chunk
                if b"\n" in data:
                    return _report(proc.pid, data.split(b"\n", 1)[0])
                if not chunk:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(1.0)
                    return ("error", proc.pid, f"receiver {proc.pid} exited "
                            f"(status {proc.returncode}) before it was ready")
            elif proc.poll() is not None:
                return ("error", proc.pid, f"receiver {proc.pid} exited "
                        f"(status {proc.returncode}) before it was ready")

    def stop(self, grace_s: float | None = None) -> list[int | None]:
        """SIGTERM every process and wait; SIGKILL what is left after the grace period.

        ``grace_s`` None waits ``smtpd.shutdown_timeout`` plus a margin for
        closing the queue.  Returns the exit codes.
        """
        if grace_s is None:
            cfg = self.config if isinstance(self.config, Config) else None
            grace_s = (cfg.smtpd.shutdown_timeout if cfg else 30.0) + 10.0
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.poll() is None:
                log.warning("receiver %s did not stop in time; killing it", proc.pid)
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5.0)
        codes = [proc.returncode for proc in self._procs]
        self._procs = []
        return codes

    def __enter__(self) -> ReceiverPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._procs:
            self.stop()

