"""The network transport under a flood: whoever can reach the port cannot use up the
daemon. Run with the daemon's default limits (``worker_agent.server``): a connection
cap counted from accept, a TLS handshake deadline, a deadline and a size limit for the
bearer preamble, and refusals logged at a bounded rate."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_network_transport import HOST, TOKEN, free_port, write_self_signed
from tests.support import DaemonProcess, short_tmp, wait_until
from worker_agent.server import (
    AUTH_DEADLINE_SECS,
    MAX_NETWORK_CONNECTIONS,
    MAX_PREAMBLE_BYTES,
    TLS_HANDSHAKE_SECS,
)

FLOOD = 300


@pytest.fixture
def tls_daemon() -> Iterator[tuple[DaemonProcess, int, Path]]:
    with short_tmp() as root:
        cert, key, token_file = root / "tls.crt", root / "tls.key", root / "token"
        write_self_signed(cert, key)
        token_file.write_text(TOKEN)
        port = free_port()
        daemon = DaemonProcess(
            root, "--listen", f"{HOST}:{port}", "--token-file", str(token_file),
            "--tls-cert", str(cert), "--tls-key", str(key),
        ).start()  # fmt: skip
        try:
            yield daemon, port, cert
        finally:
            daemon.stop()


def open_fds(daemon: DaemonProcess) -> int:
    assert daemon.proc is not None
    return len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))


def closed_by_peer(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def tls_connect(port: int, cert: Path) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(cert))
    raw = socket.create_connection((HOST, port), timeout=10)
    return context.wrap_socket(raw, server_hostname=HOST)


def test_a_flood_of_silent_connections_is_capped_and_the_local_socket_keeps_answering(
    tls_daemon: tuple[DaemonProcess, int, Path],
) -> None:
    """Tried: 300 TCP connections to the TLS port that never start the handshake."""
    daemon, port, _ = tls_daemon
    before = open_fds(daemon)
    log_lines = len(daemon.log.read_text().splitlines())
    flood = [socket.create_connection((HOST, port), timeout=5) for _ in range(FLOOD)]
    try:
        with daemon.client(timeout=5) as client:
            client.status()
        # Everything past the cap is closed at once; the rest when the handshake is due.
        wait_until(
            lambda: sum(closed_by_peer(s) for s in flood) >= FLOOD - MAX_NETWORK_CONNECTIONS,
            5,
            "connections over the cap to be closed",
        )
        assert open_fds(daemon) - before <= MAX_NETWORK_CONNECTIONS + 2
        wait_until(
            lambda: all(closed_by_peer(s) for s in flood),
            TLS_HANDSHAKE_SECS + 5,
            "silent connections to be closed at the handshake deadline",
        )
    finally:
        for sock in flood:
            sock.close()
    wait_until(lambda: open_fds(daemon) <= before + 2, 5, "the daemon's fds to be released")
    with daemon.client(timeout=5) as client:
        client.status()
    logged = len(daemon.log.read_text().splitlines()) - log_lines
    assert logged < 100, f"{logged} log lines for one flood"


def test_a_tls_connection_that_sends_no_preamble_is_closed_at_the_deadline(
    tls_daemon: tuple[DaemonProcess, int, Path],
) -> None:
    """Tried: a TLS handshake, then silence."""
    _, port, cert = tls_daemon
    with tls_connect(port, cert) as conn:
        conn.settimeout(AUTH_DEADLINE_SECS + 5)
        started = time.monotonic()
        assert conn.recv(1) == b""
        assert time.monotonic() - started >= AUTH_DEADLINE_SECS - 1


def test_an_over_long_preamble_is_not_buffered_and_closes_the_connection(
    tls_daemon: tuple[DaemonProcess, int, Path],
) -> None:
    """Tried: a preamble line past upstream's limit (4096 bytes), then a request."""
    _, port, cert = tls_daemon
    with tls_connect(port, cert) as conn:
        conn.settimeout(AUTH_DEADLINE_SECS + 5)
        bearer = "x" * (MAX_PREAMBLE_BYTES + 10)
        try:
            conn.sendall(b'{"bearer": "' + bearer.encode() + b'"}\n{"kind": "status"}\n')
            assert conn.recv(4096) == b""
        except (ConnectionError, ssl.SSLError):
            pass  # a reset is as good as a close


def test_a_flood_of_wrong_preambles_is_logged_at_a_bounded_rate(
    tls_daemon: tuple[DaemonProcess, int, Path],
) -> None:
    """Tried: 50 connections in a row, each with a wrong bearer token."""
    daemon, port, cert = tls_daemon
    log_lines = len(daemon.log.read_text().splitlines())
    for _ in range(50):
        with tls_connect(port, cert) as conn:
            conn.sendall(b'{"bearer": "wrong-token-0123456789"}\n{"kind": "status"}\n')
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                assert conn.recv(4096) == b""
    with daemon.client(timeout=5) as client:
        client.status()
    logged = len(daemon.log.read_text().splitlines()) - log_lines
    assert logged <= 15, f"{logged} log lines for 50 refusals"
