"""A private Postfix instance on loopback, for the maillog and round-trip tests.

Postfix 3.7 (the distribution package) runs from a temporary directory:
its own main.cf/master.cf, queue, and ``maillog_file`` written by
postlogd, an smtpd on 127.0.0.1 and the relay host an aiosmtpd sink in
this process that answers per recipient: ``bad*`` 550 5.1.1, ``full*``
452 4.2.2, anything else 250.  Mail for dead.test goes to a port nobody
listens on.  Queue lifetimes are seconds, so deferred mail expires (and
its NDR is sent) while the test waits.  With ``mailbox_domain``, mail for
that domain is delivered by Postfix's virtual(8) agent into one mbox file
(``PostfixRun.mailbox``).  Everything is removed at the end.
"""

from __future__ import annotations

import os
import pwd
import shutil
import smtplib
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.message import EmailMessage
from pathlib import Path
from typing import Any

POSTFIX = shutil.which("postfix") or "/usr/sbin/postfix"


def postfix_missing() -> str | None:
    """Why the real-Postfix test cannot run here, or None."""
    if not Path(POSTFIX).exists() or not Path("/usr/lib/postfix/sbin/master").exists():
        return "Postfix is not installed (apt-get install postfix)"
    if os.geteuid() != 0:
        return "a private Postfix instance needs root (its master drops privileges)"
    try:
        pwd.getpwnam("postfix")
    except KeyError:
        return "the postfix user does not exist"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Sink:
    """aiosmtpd handler: per-recipient answers, records what it accepted."""

    accepted: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)

    async def handle_RCPT(self, server: Any, session: Any, envelope: Any, address: str,
                          rcpt_options: Any) -> str:
        local = address.partition("@")[0].lower()
        if local.startswith("bad"):
            return f"550 5.1.1 <{address}>: Recipient address rejected: User unknown"
        if local.startswith("full"):
            return f"452 4.2.2 <{address}>: Mailbox full, try again later"
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 Ok"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.accepted.append((envelope.mail_from, tuple(envelope.rcpt_tos)))
        return f"250 2.0.0 Ok: queued as SINK{len(self.accepted):04d}"


MAIN_CF = """\
compatibility_level = 3.6
queue_directory = {root}/spool
data_directory = {root}/data
command_directory = /usr/sbin
daemon_directory = /usr/lib/postfix/sbin
meta_directory = /etc/postfix
shlib_directory = /usr/lib/postfix
mail_owner = postfix
setgid_group = postdrop
myhostname = mta.maillog.test
mydomain = maillog.test
myorigin = $myhostname
mydestination =
relay_domains =
local_recipient_maps =
alias_maps =
alias_database =
inet_interfaces = 127.0.0.1
inet_protocols = ipv4
mynetworks = 127.0.0.0/8
smtpd_relay_restrictions = permit_mynetworks, reject_unauth_destination
smtpd_recipient_restrictions =
smtpd_peername_lookup = no
relayhost = [127.0.0.1]:{sink_port}
transport_maps = inline:{{ dead.test=smtp:[127.0.0.1]:{dead_port} }}
smtp_dns_support_level = disabled
smtp_host_lookup = native
smtp_connect_timeout = 2s
biff = no
append_dot_mydomain = no
queue_run_delay = 1s
minimal_backoff_time = 1s
maximal_backoff_time = 1s
maximal_queue_lifetime = 3s
bounce_queue_lifetime = 3s
maillog_file = {root}/maillog
maillog_file_prefixes = {root}
"""

MAILBOX_CF = """\
virtual_mailbox_domains = {domain}
virtual_mailbox_base = {root}/mail
virtual_mailbox_maps = static:mbox
virtual_uid_maps = static:{uid}
virtual_gid_maps = static:{gid}
virtual_transport = virtual
"""

MASTER_CF = """\
127.0.0.1:{smtpd_port} inet n - n - - smtpd
pickup    unix  n       -       n       60      1       pickup
cleanup   unix  n       -       n       -       0       cleanup
qmgr      unix  n       -       n       300     1       qmgr
rewrite   unix  -       -       n       -       -       trivial-rewrite
bounce    unix  -       -       n       -       0       bounce
defer     unix  -       -       n       -       0       bounce
trace     unix  -       -       n       -       0       bounce
verify    unix  -       -       n       -       1       verify
flush     unix  n       -       n       1000?   0       flush
proxymap  unix  -       -       n       -       -       proxymap
smtp      unix  -       -       n       -       -       smtp
relay     unix  -       -       n       -       -       smtp
showq     unix  n       -       n       -       -       showq
error     unix  -       -       n       -       -       error
retry     unix  -       -       n       -       -       error
discard   unix  -       -       n       -       -       discard
anvil     unix  -       -       n       -       1       anvil
scache    unix  -       -       n       -       1       scache
postlog   unix-dgram n  -       n       -       1       postlogd
virtual   unix  -       n       n       -       -       virtual
"""


@dataclass
class PostfixRun:
    root: Path
    smtpd_port: int
    sink: Sink

    @property
    def maillog(self) -> Path:
        return self.root / "maillog"

    @property
    def mailbox(self) -> Path:
        """The mbox file of ``mailbox_domain`` (all its recipients share it)."""
        return self.root / "mail" / "mbox"

    def send(self, sender: str, recipients: list[str], subject: str) -> None:
        msg = EmailMessage()
        msg["From"] = sender
        msg["To"] = ", ".join(recipients)
        msg["Subject"] = subject
        msg.set_content("test body\n")
        with smtplib.SMTP("127.0.0.1", self.smtpd_port, local_hostname="client.test",
                          timeout=10) as client:
            client.send_message(msg, from_addr=sender, to_addrs=recipients)

    def postfix(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([POSTFIX, "-c", str(self.root / "etc"), *args],
                              capture_output=True, text=True, timeout=60, check=False)

    def wait_for(self, predicate: Any, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            text = self.maillog.read_text() if self.maillog.exists() else ""
            if predicate(text):
                return text
            time.sleep(0.2)
        raise TimeoutError(f"Postfix did not log what was expected; maillog:\n{text}")

    def queue_is_empty(self) -> bool:
        spool = self.root / "spool"
        return not any(
            f.is_file() for d in ("incoming", "active", "deferred", "maildrop")
            for f in (spool / d).rglob("*")
        )


def _wait_gone(pid_file: Path, timeout_s: float = 10.0) -> None:
    """Wait until the master named in ``pid_file`` has exited."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


@contextmanager
def postfix_instance(mailbox_domain: str | None = None) -> Iterator[PostfixRun]:
    from aiosmtpd.controller import Controller

    root = Path(tempfile.mkdtemp(prefix="sluice-pf-"))  # short: socket paths are limited
    sink = Sink()
    sink_port, smtpd_port, dead_port = free_port(), free_port(), free_port()
    controller = Controller(sink, hostname="127.0.0.1", port=sink_port,
                            server_hostname="sink.test")
    run = PostfixRun(root, smtpd_port, sink)
    started = False
    try:
        controller.start()
        (root / "etc").mkdir()
        (root / "spool").mkdir(mode=0o755)
        data = root / "data"
        data.mkdir(mode=0o700)
        pw = pwd.getpwnam("postfix")
        os.chown(data, pw.pw_uid, pw.pw_gid)
        os.chmod(root, 0o755)
        main_cf = MAIN_CF.format(root=root, sink_port=sink_port, dead_port=dead_port)
        if mailbox_domain:
            nobody = pwd.getpwnam("nobody")
            (root / "mail").mkdir(mode=0o755)
            os.chown(root / "mail", nobody.pw_uid, nobody.pw_gid)
            main_cf += MAILBOX_CF.format(domain=mailbox_domain, root=root, uid=nobody.pw_uid,
                                         gid=nobody.pw_gid)
        (root / "etc" / "main.cf").write_text(main_cf)
        (root / "etc" / "master.cf").write_text(MASTER_CF.format(smtpd_port=smtpd_port))
        check = run.postfix("check")
        if check.returncode != 0:
            raise RuntimeError(f"postfix check failed: {check.stderr or check.stdout}")
        start = run.postfix("start")
        if start.returncode != 0:
            raise RuntimeError(f"postfix start failed: {start.stderr or start.stdout}")
        started = True
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", smtpd_port)) == 0:
                    break
            time.sleep(0.1)
        else:
            raise RuntimeError("Postfix's smtpd did not start listening")
        yield run
    finally:
        if started:
            stop = run.postfix("stop")
            if stop.returncode != 0:
                run.postfix("abort")
            _wait_gone(root / "spool" / "pid" / "master.pid")
        controller.stop()
        shutil.rmtree(root, ignore_errors=True)
