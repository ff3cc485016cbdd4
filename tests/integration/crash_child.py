"""Child process of the crash test: submits in a loop until it is killed.

Prints ``ACK <spid> <sha256>`` for every submission that returned, i.e. that
the store promised is durable.  Content is self-checking: it ends with a line
carrying the SHA-256 of everything before it.

usage: python -m tests.integration.crash_child CONFIG THREADS
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import threading
import time

from sluice.config import load_config
from sluice.model import Submission
from sluice.store import open_store

CHECK = b"\r\nX-Check: "


def make_content(rng: random.Random, n: int) -> bytes:
    size = rng.choice([100, 1000, 10_000, 200_000])
    body = f"Subject: crash {n}\r\n\r\n".encode() + rng.randbytes(size).hex().encode()
    return body + CHECK + hashlib.sha256(body).hexdigest().encode() + b"\r\n"


def verify(content: bytes) -> bool:
    """Whether self-checking content is whole."""
    body, sep, tail = content.rpartition(CHECK)
    return bool(sep) and tail.strip() == hashlib.sha256(body).hexdigest().encode()


def main() -> None:
    cfg = load_config(sys.argv[1])
    threads = int(sys.argv[2])
    store = open_store(cfg)
    out_lock = threading.Lock()

    def worker(k: int) -> None:
        rng = random.Random(os.getpid() * 1000 + k)
        n = 0
        while True:
            n += 1
            content = make_content(rng, n)
            rcpts = tuple(f"r{i}@d{rng.randrange(5)}.example" for i in range(rng.randint(1, 3)))
            acc = store.submit(Submission("crash@example.org", rcpts), content, time.time())
            line = f"ACK {acc.spid} {hashlib.sha256(content).hexdigest()} {len(rcpts)}\n"
            with out_lock:
                sys.stdout.write(line)
                sys.stdout.flush()

    for k in range(threads):
        threading.Thread(target=worker, args=(k,), daemon=True).start()
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
