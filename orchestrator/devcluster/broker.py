"""The dev stack's embedded broker: fakeredis's TCP server, so ``drainctl dev up`` speaks
the same ``redis://`` transport as production without a Redis installed.

kombu's filesystem transport, the earlier embedded default, has no acknowledgements: a
consumer killed after it took a message loses it (a pause drain then waits out its
deadline), and a reader racing a writer can find an empty message file. Over the Redis
protocol kombu keeps every delivered message in its unacked set until it is acked and
restores it after the visibility timeout, exactly as on a real Redis, so the fault
tests' redelivery guarantees hold on the embedded default too.

It runs as a child process of ``dev up`` (``python -m orchestrator.devcluster.broker
--port P``) so the stack's Celery traffic does not compete with the embedded API for
one interpreter. Queues live in its memory: a restarted stack starts with empty queues,
and what was in flight is redelivered by nobody — the ledger's deadline sweeper closes
such operations with their reason, and the operator begins them again.
"""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

from orchestrator.devcluster.apiserver import DevClusterError

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


PORT_FILE = "embedded-broker-port"
"""Where a dev stack keeps its embedded broker's port, in its state dir."""
PORT_FREED_WITHIN_SECS = 10.0
"""How long a restarted stack waits for its old broker's port to be free."""


def kept_port(state_dir: Path) -> int:
    """The embedded broker's port for the stack whose state is ``state_dir``: the one it
    had before when it is free again, else a new one (kept for the next start).

    A restarted stack's pods read the broker URL from the Secret its operator wrote, at
    their start: the pods that the restarted Sandbox controller brings back at once,
    before the operator's first pass, would read the old one. On another port they would
    retry a dead address for ever, and their tasks never resume."""
    path = state_dir / PORT_FILE
    try:
        port = int(path.read_text())
    except (OSError, ValueError):
        port = 0
    deadline = time.monotonic() + PORT_FREED_WITHIN_SECS
    while port and not _bindable(port):
        if time.monotonic() > deadline:  # taken by something else: a new one
            port = 0
            break
        time.sleep(0.1)  # the killed stack's broker may still be exiting
    if not port:
        port = free_port()
        path.write_text(f"{port}\n")
    return port


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


def wait_serving(port: int, within: float = 30.0) -> None:
    """Return once the broker answers PING on ``port``; DevClusterError after ``within``."""
    deadline = time.monotonic() + within
    while True:
        try:
            with socket.create_connection((HOST, port), timeout=1) as conn:
                conn.sendall(b"*1\r\n$4\r\nPING\r\n")  # RESP: the server reads no inline commands
                if conn.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise DevClusterError(f"the embedded broker on {HOST}:{port} did not answer PING")
        time.sleep(0.05)


PUSH_POLL_SECS = 0.05
"""How often each connection's thread looks for a reply pushed to it from elsewhere (a
pub/sub message). fakeredis looks every 10 ms, for every connection, idle or not: 150
idle connections cost 59 % of a core, 16 % at 50 ms, and a dev stack of 45 tasks holds
about 200 (each daemon's consumer, publisher and result backend). On 2 cores that
polling starved the whole stack: under a burst of 17 creates and 16 deletes, healthy
tasks' heartbeats expired in the queue and all 12 went DaemonSilent (``bench/burst.py``).
A command's own reply, a blocking pop woken by a push included, still goes out at once;
only pub/sub messages wait up to this long."""


def serve(port: int) -> None:
    import fakeredis._clients._tcp_server as tcp_server
    from fakeredis import TcpFakeServer

    tcp_server._POLL_INTERVAL = PUSH_POLL_SECS  # the handler reads it at every turn
    server = TcpFakeServer((HOST, port), server_type="redis")
    server.daemon_threads = True  # a connection's thread never holds the exit
    server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description="the dev stack's embedded Redis-protocol broker")
    parser.add_argument("--port", type=int, required=True)
    serve(parser.parse_args().port)


if __name__ == "__main__":
    main()
