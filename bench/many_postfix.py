#!/usr/bin/env python3
"""A private Postfix for the many-destinations mix: one transport map entry, one queue per domain.

    python bench/many_postfix.py [--n 20000] [--sessions 20] [--domains 10000]
                                 [--size 1024] [--quiet-wait 60]
    (inside a private network namespace; bench/e2e.py enters one itself)

The instance is the shared harness's (../shared/bench/postfix_e2e.sh: the
same main.cf and master.cf, fsync before 250, the maillog on, default
process limits) with one change: no relayhost; instead `transport_maps =
hash:.../transport` sends each domain dK.test to its own next hop
[127.10.X.Y]:2526 (bench/many_routes.py).  qmgr keys its queues by
transport and next hop, so it keeps one queue per domain, each with its own
concurrency window, as it would for 10,000 remote domains.  hash (Berkeley
DB, built with postmap) is used because Debian's postfix has neither lmdb
nor pcre built in, and a regexp map would be walked entry by entry.

The script cannot be reused as it stands because it writes its main.cf
with a relayhost, so the instance lives in its own root,
/tmp/pfbench-many, and runs bench/many_run.py as its driver.  After the run
the maillog must show N `status=sent` lines, no deferral or bounce, and as
many distinct `relay=` addresses as domains were used: the proof that each
domain went to its own next hop.  Last line as the harness's, plus
`relays=` (that count).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import many_routes

HERE = Path(__file__).resolve().parent
PFROOT = Path("/tmp/pfbench-many")
MTA_PORT, SINK_PORT = 2525, 2526
RELAY_RE = re.compile(r" relay=[^\[\s]*\[([0-9.]+)\]:\d+,")

MAIN_CF = """\
compatibility_level = 3.6
queue_directory = {spool}
data_directory = {data}
command_directory = /usr/sbin
daemon_directory = /usr/lib/postfix/sbin
meta_directory = /etc/postfix
shlib_directory = /usr/lib/postfix
mail_owner = postfix
setgid_group = postdrop
myhostname = mta.bench.test
mydomain = bench.test
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
transport_maps = hash:{conf}/transport
smtp_dns_support_level = disabled
smtp_host_lookup = native
lmtp_host_lookup = native
biff = no
append_dot_mydomain = no
maillog_file = {root}/maillog
maillog_file_prefixes = {root}
"""

# Debian's master.cf without chroot, smtpd on 127.0.0.1:MTA_PORT (as postfix_e2e.sh).
MASTER_CF = """\
127.0.0.1:{port} inet n - n - - smtpd
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
proxywrite unix -       -       n       -       1       proxymap
smtp      unix  -       -       n       -       -       smtp
relay     unix  -       -       n       -       -       smtp
showq     unix  n       -       n       -       -       showq
error     unix  -       -       n       -       -       error
retry     unix  -       -       n       -       -       error
discard   unix  -       -       n       -       -       discard
local     unix  -       n       n       -       -       local
virtual   unix  -       n       n       -       -       virtual
lmtp      unix  -       -       n       -       -       lmtp
anvil     unix  -       -       n       -       1       anvil
scache    unix  -       -       n       -       1       scache
postlog   unix-dgram n  -       n       -       1       postlogd
"""


class Instance:
    """The Postfix under PFROOT: configure(), start() -> master pid, stop(), clean()."""

    def __init__(self, root: Path = PFROOT) -> None:
        self.root = root
        self.conf, self.spool = root / "etc", root / "spool"
        self.data, self.run = root / "data", root / "run"

    def postfix(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["postfix", "-c", str(self.conf), *args],
                              capture_output=True, text=True)

    def master_pid(self) -> int:
        try:
            return int((self.spool / "pid" / "master.pid").read_text().strip())
        except (OSError, ValueError):
            return 0

    def stop(self) -> None:
        pid = self.master_pid()
        if not (self.conf / "main.cf").exists() or not pid or not alive(pid):
            return
        self.postfix("stop")
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(pid):
            self.postfix("abort")
            time.sleep(1)

    def clean(self) -> None:
        shutil.rmtree(self.spool, ignore_errors=True)
        shutil.rmtree(self.data, ignore_errors=True)

    def configure(self, domains: int) -> None:
        self.stop()
        self.clean()
        shutil.rmtree(self.run, ignore_errors=True)
        (self.root / "maillog").unlink(missing_ok=True)
        for d in (self.conf, self.spool, self.data, self.run):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        os.chmod(self.spool, 0o755)
        shutil.chown(self.data, "postfix", "postfix")
        os.chmod(self.data, 0o700)
        (self.conf / "main.cf").write_text(MAIN_CF.format(
            spool=self.spool, data=self.data, conf=self.conf, root=self.root))
        (self.conf / "master.cf").write_text(MASTER_CF.format(port=MTA_PORT))
        (self.conf / "transport").write_text(many_routes.postfix_transport(domains, SINK_PORT))
        made = subprocess.run(["postmap", "-c", str(self.conf), f"hash:{self.conf}/transport"],
                              capture_output=True, text=True)
        if made.returncode != 0:
            raise RuntimeError(f"postmap failed: {made.stderr.strip()}")
        chk = self.postfix("check")
        if chk.returncode != 0:
            raise RuntimeError(f"postfix check failed: {chk.stderr.strip()}")

    def start(self) -> int:
        out = self.postfix("start")
        deadline = time.monotonic() + 10
        while not (pid := self.master_pid()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pid:
            raise RuntimeError(f"postfix did not start: {out.stderr.strip()}")
        return pid

    def maillog_check(self, n: int, domains: int) -> int:
        """Distinct relay addresses in the maillog; raises unless all n were sent."""
        text = (self.root / "maillog").read_text(errors="replace")
        sent = text.count(" status=sent ")
        other = len(re.findall(r" status=(?:deferred|bounced)", text))
        relays = {m.group(1) for m in RELAY_RE.finditer(text)}
        if sent != n or other:
            raise RuntimeError(f"maillog: status=sent {sent} (expected {n}), "
                               f"deferred/bounced {other}")
        if len(relays) != min(n, domains):
            raise RuntimeError(f"maillog: {len(relays)} distinct relays, "
                               f"expected {min(n, domains)}")
        return len(relays)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def run(n: int, sessions: int, size: int, domains: int, quiet_wait: float,
        timeout: float = 900.0) -> dict[str, str]:
    """One Postfix run of the mix; returns the driver's fields plus relays."""
    many_routes.check_private_netns()
    pf = Instance()
    pf.configure(domains)
    try:
        pid = pf.start()
        cmd = [sys.executable, str(HERE / "many_run.py"), "--label", "postfix",
               "--mta-port", str(MTA_PORT), "--sink-port", str(SINK_PORT),
               "--n", str(n), "--sessions", str(sessions), "--domains", str(domains),
               "--size", str(size), "--mta-pid", str(pid), "--timeout", str(timeout),
               "--quiet-wait", str(quiet_wait), "--workdir", str(pf.run)]
        for d in ("incoming", "active", "deferred", "hold", "maildrop"):
            cmd += ["--queue-dir", str(pf.spool / d)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 600)
        (pf.run / "driver.out").write_text(out.stdout + out.stderr)
        last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
        if out.returncode != 0 or not last.startswith("postfix "):
            raise RuntimeError(f"postfix run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        pf.stop()
        relays = pf.maillog_check(n, domains)
    finally:
        pf.stop()
        pf.clean()
    fields = dict(kv.split("=", 1) for kv in last.split()[1:])
    fields["relays"] = str(relays)
    return fields


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--domains", type=int, default=10000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--quiet-wait", type=float, default=60)
    a = ap.parse_args()
    try:
        res = run(a.n, a.sessions, a.size, a.domains, a.quiet_wait)
    except RuntimeError as exc:
        sys.exit(f"many_postfix: {exc}")
    print("postfix " + " ".join(f"{k}={v}" for k, v in res.items()))


if __name__ == "__main__":
    main()
