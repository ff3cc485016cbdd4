"""The receiving side: Sluice's own ESMTP server, which queues what it accepts.

SUMMARY
    Receiver.from_config(config, queue) -> Receiver; await start() / stop()
    ReceiverPool(config, processes).start() / .stop()   several processes, one port
    run_receiver_process(config, ready)                  the body of one of them
    ReceivePolicy, Credentials, received_header           the typed rules underneath

DESCRIPTION
    Mail enters Sluice here.  A Receiver listens on ``smtpd.listen``,
    speaks ESMTP with SIZE, 8BITMIME, PIPELINING, SMTPUTF8,
    ENHANCEDSTATUSCODES, STARTTLS and AUTH PLAIN/LOGIN (over TLS only),
    refuses to relay for strangers, runs the end-of-DATA hook, adds a
    Received header, and answers 250 only once the queue says the message
    is durable.  docs/smtpd.md tells operators and ``sluice serve`` how to
    run it.

MODULES
    policy       what may pass, as Reply values (pure)
    credentials  AUTH users, Dovecot-style password hashes, checks off the loop
    content      DATA pieces: end detection, unstuffing, limits, spilling
    trace        the Received header
    protocol     the RFC 5321 state machine as a table, command parsing (pure)
    envelope     MAIL and RCPT arguments, the transaction (pure)
    inbox        buffered input of one connection: lines and DATA pieces
    session      the SMTP server protocol, one object per connection
    settings     what a receiver's sessions share; the registry of open ones
    handoff      submits to the queue off the event loop, relays the durable result
    dedupe       resent messages answered with the first queue id (smtpd.dedupe)
    server       Receiver: sockets, limits, graceful stop
    worker       receiving processes sharing the listening sockets the parent bound
"""

from sluice.smtpd.credentials import Credentials, hash_password
from sluice.smtpd.policy import (
    Client,
    ContentState,
    Networks,
    RcptAction,
    RcptVerdict,
    ReceivePolicy,
)
from sluice.smtpd.server import (
    Receiver,
    ReceiverError,
    ReceiverParts,
    bind_listeners,
    listen_addresses,
    load_tls_context,
    parse_listen,
    receiver_parts,
)
from sluice.smtpd.settings import ReceiverStats, Settings
from sluice.smtpd.trace import protocol_name, received_header
from sluice.smtpd.worker import ReceiverPool, receiver_processes, run_receiver_process

__all__ = [
    "Client",
    "ContentState",
    "Credentials",
    "Networks",
    "RcptAction",
    "RcptVerdict",
    "ReceivePolicy",
    "Receiver",
    "ReceiverError",
    "ReceiverParts",
    "ReceiverPool",
    "ReceiverStats",
    "Settings",
    "bind_listeners",
    "hash_password",
    "listen_addresses",
    "load_tls_context",
    "parse_listen",
    "protocol_name",
    "received_header",
    "receiver_parts",
    "receiver_processes",
    "run_receiver_process",
]
