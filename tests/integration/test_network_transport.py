"""The network transport: TLS, then a bearer preamble line (upstream's ADR 0051 shape),
nothing less.

A self-signed certificate is made in the test (SAN ``IP:127.0.0.1`` and
``DNS:localhost``) and the client trusts exactly that certificate. The Unix transport's
file modes are checked here too, as the local half of the same access rule.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import socket
import ssl
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.support import DaemonProcess, short_tmp, wait_until
from worker_agent.client import SupervisorClient
from worker_agent.proto import Listed, StatusReply

HOST = "127.0.0.1"
TOKEN = "s3cret-token-for-tests-0123456789"


def write_self_signed(cert_path: Path, key_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "caliban-drain test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.IPv4Address(HOST)), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class Network:
    daemon: DaemonProcess
    root: Path
    port: int
    cert: Path
    key: Path
    token_file: Path

    def client(self, token: str | None) -> SupervisorClient:
        return SupervisorClient(
            address=(HOST, self.port), token=token, cafile=self.cert, timeout=10
        )


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    with short_tmp() as root:
        cert, key, token_file = root / "tls.crt", root / "tls.key", root / "token"
        write_self_signed(cert, key)
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)
        port = free_port()
        daemon = DaemonProcess(
            root,
            "--listen", f"{HOST}:{port}", "--token-file", str(token_file),
            "--tls-cert", str(cert), "--tls-key", str(key),
        )  # fmt: skip
        daemon.socket = root / "run" / "ctl.sock"  # a directory the daemon creates itself
        daemon.start()
        net = Network(daemon, root, port, cert, key, token_file)

        def tls_ready() -> bool:
            try:
                with net.client(TOKEN) as client:
                    client.status()
            except OSError:
                return False
            return True

        try:
            wait_until(tls_ready, 20, f"TLS listener on {HOST}:{port}")
            yield net
        finally:
            daemon.stop()


def test_right_token_over_tls_serves_status_and_list(network: Network) -> None:
    with network.client(TOKEN) as client:
        status = client.status()
        assert isinstance(status, StatusReply)
        assert network.daemon.proc is not None
        assert status.pid == network.daemon.proc.pid
        listed = client.call("list")
        assert isinstance(listed, Listed)
        assert listed.agents == []
        # The connection stays authorised for further requests.
        assert client.status().pid == status.pid


def test_localhost_name_in_the_certificate_verifies(network: Network) -> None:
    with SupervisorClient(
        address=(HOST, network.port),
        token=TOKEN,
        cafile=network.cert,
        server_hostname="localhost",
        timeout=10,
    ) as client:
        assert client.status().agents == 0


def closes(client: SupervisorClient, kind: str) -> bool:
    """Whether the daemon closes the connection instead of answering ``kind``."""
    try:
        client.call(kind)
    except (ConnectionError, ssl.SSLError):
        return True
    return False


@pytest.mark.parametrize(
    "token",
    [
        pytest.param(None, id="no_preamble"),
        pytest.param("", id="empty_token"),
        pytest.param("wrong", id="wrong_short_token"),
        pytest.param(TOKEN[:-1] + "X", id="wrong_token_of_equal_length"),
        pytest.param(TOKEN + "X", id="right_token_plus_a_suffix"),
        pytest.param(TOKEN.upper(), id="right_token_in_upper_case"),
    ],
)
def test_a_bad_preamble_closes_the_connection_unanswered(
    network: Network, token: str | None
) -> None:
    """Tried: no preamble (a request first), and bearer tokens that are not ours. As
    upstream's transport does, the connection is closed before any request is read."""
    for kind in ("status", "shutdown"):
        with network.client(token) as client:
            assert closes(client, kind), f"{kind} answered with bearer {token!r}"
    # None of it (not even the shutdown) reached the supervisor.
    with network.client(TOKEN) as client:
        assert client.status().agents == 0
    assert "reason=" in network.daemon.log.read_text()


@pytest.mark.parametrize(
    "preamble",
    [b'{"bearer": 12345}\n', b'{"token": "x"}\n', b"bearer\n", b'"' + TOKEN.encode() + b'"\n'],
    ids=["bearer-not-a-string", "no-bearer", "not-json", "bare-string"],
)
def test_a_malformed_preamble_closes_the_connection(network: Network, preamble: bytes) -> None:
    """Tried: preamble lines upstream's ``TokenPreamble`` would not parse."""
    context = ssl.create_default_context(cafile=str(network.cert))
    with (
        socket.create_connection((HOST, network.port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=HOST) as conn,
    ):
        conn.sendall(preamble + b'{"kind": "status"}\n')
        with contextlib.suppress(ConnectionError, ssl.SSLError):  # a reset is as good
            assert conn.recv(4096) == b""


def test_plaintext_tcp_gets_no_protocol_service(network: Network) -> None:
    request = json.dumps({"bearer": TOKEN}).encode() + b'\n{"kind": "status"}\n'
    received = b""
    with socket.create_connection((HOST, network.port), timeout=10) as raw:
        try:
            raw.sendall(request)
            while chunk := raw.recv(4096):
                received += chunk
        except ConnectionError:
            pass  # a reset is as good as a close
    assert b'"kind"' not in received, received
    assert b"status" not in received, received
    # The listener itself is fine afterwards.
    with network.client(TOKEN) as client:
        assert client.status().agents == 0


def test_unix_socket_is_0600_in_a_0700_directory(network: Network) -> None:
    sock = network.daemon.socket
    info = os.stat(sock)
    assert stat.S_ISSOCK(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o600, oct(info.st_mode)
    assert info.st_uid == os.getuid()
    parent = os.stat(sock.parent)
    assert stat.S_IMODE(parent.st_mode) == 0o700, oct(parent.st_mode)


def run_daemon_expecting_refusal(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable, "-m", "orchestrator.cli", "daemon",
            "--store", str(root / "refused-store"), "--socket", str(root / "refused.sock"),
            "--listen", f"{HOST}:{free_port()}", *extra,
        ],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_listen_without_token_file_refuses_to_start(network: Network) -> None:
    result = run_daemon_expecting_refusal(
        network.root, "--tls-cert", str(network.cert), "--tls-key", str(network.key)
    )
    assert result.returncode != 0, result
    assert "--token-file" in result.stderr, result.stderr
    assert not (network.root / "refused.sock").exists()


@pytest.mark.parametrize("missing", ["--tls-cert", "--tls-key"])
def test_listen_without_tls_refuses_to_start(network: Network, missing: str) -> None:
    given = {
        "--token-file": str(network.token_file),
        "--tls-cert": str(network.cert),
        "--tls-key": str(network.key),
    }
    del given[missing]
    result = run_daemon_expecting_refusal(network.root, *(x for kv in given.items() for x in kv))
    assert result.returncode != 0, result
    assert missing in result.stderr, result.stderr
    assert "TLS" in result.stderr, result.stderr


def test_short_token_refuses_to_start(network: Network) -> None:
    short = network.root / "short-token"
    short.write_text("too-short\n")
    result = run_daemon_expecting_refusal(
        network.root,
        "--token-file", str(short),
        "--tls-cert", str(network.cert), "--tls-key", str(network.key),
    )  # fmt: skip
    assert result.returncode != 0, result
    assert str(short) in result.stderr, result.stderr
    assert "at least 16 characters" in result.stderr, result.stderr
