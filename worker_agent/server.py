"""The accept loop: NDJSON over a Unix socket (local) and over TCP with TLS (network).

Each connection is served in its own task, one request at a time, one reply per
request, so a long drain on one connection never holds up ``list`` on another. A bad
line gets an ``error`` reply and the connection stays usable; a line over 1 MiB is
skipped to its newline; a blank line is skipped, as caliband does. On the network
transport a client authenticates as upstream's ``transport.rs`` does (ADR 0051): TLS,
then one preamble line ``{"bearer": TOKEN}``, compared in constant time, before any
request is read; a wrong, late or malformed preamble closes the connection.

The network transport is open to whoever can reach the port, so it is bounded: at most
``MAX_NETWORK_CONNECTIONS`` at once (counted from accept, before the TLS handshake), a
handshake deadline and a preamble deadline; refusals are logged at a bounded rate.
Nothing a network client does can use up the daemon's file descriptors and lock out the
local socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import ssl
import stat
import time
from pathlib import Path

from worker_agent import proto, unixpath
from worker_agent.consumer_process import consumer_process
from worker_agent.logformat import set_process_context
from worker_agent.probes import DaemonProbes
from worker_agent.proto import MAX_LINE_BYTES, ErrorKind, ProtocolError
from worker_agent.settings import DaemonSettings
from worker_agent.store import StoreInUse
from worker_agent.supervisor import Supervisor

log = logging.getLogger(__name__)

MAX_NETWORK_CONNECTIONS = 64
"""Network connections served at once; one more is closed as soon as it is accepted."""
TLS_HANDSHAKE_SECS = 10.0
"""A network client must finish the TLS handshake within this."""
AUTH_DEADLINE_SECS = 10.0
"""A network client must send its bearer preamble within this after the handshake."""
MAX_PREAMBLE_BYTES = 4096
"""The longest preamble line read (upstream's limit); a longer one closes the connection."""


class RateLimitedLog:
    """At most ``burst`` lines per ``period`` per event; the rest are counted, and the
    count is reported with the next line that gets through."""

    def __init__(self, burst: int = 10, period: float = 10.0) -> None:
        self.burst = burst
        self.period = period
        self._windows: dict[str, tuple[float, int, int]] = {}

    def warning(self, event: str, message: str, *args: object) -> None:
        now = time.monotonic()
        started, sent, dropped = self._windows.get(event, (now, 0, 0))
        if now - started >= self.period:
            started, sent = now, 0
        if sent >= self.burst:
            self._windows[event] = (started, sent, dropped + 1)
            return
        self._windows[event] = (started, sent + 1, 0)
        suffix = f" suppressed={dropped}" if dropped else ""
        log.warning(f"{event} {message}{suffix}", *args)


class ConfigError(Exception):
    """The daemon cannot start with these settings; the message says what to change."""


class _LineTooLong:
    """Marks a request line that was over the limit and has been skipped."""


async def read_request_line(reader: asyncio.StreamReader) -> bytes | _LineTooLong | None:
    """The next line; ``_LineTooLong`` after skipping an over-long one; None at EOF."""
    skipping = False
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            return None if skipping or not exc.partial.strip() else exc.partial
        except asyncio.LimitOverrunError as exc:
            skipping = True
            await reader.readexactly(exc.consumed)
            continue
        return _LineTooLong() if skipping else line


def _tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS certificate {cert} / key {key}: {exc}") from None
    return context


def _read_token(path: Path) -> bytes:
    try:
        token = path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc.strerror}") from None
    if len(token) < 16:
        raise ConfigError(f"token file {path} must hold a token of at least 16 characters")
    return token


class ControlServer:
    def __init__(self, settings: DaemonSettings, supervisor: Supervisor) -> None:
        self.settings = settings
        self.supervisor = supervisor
        self._servers: list[asyncio.Server] = []
        self._connections: set[asyncio.Task[None]] = set()
        self._network: set[asyncio.Task[None]] = set()
        self._refusals = RateLimitedLog()
        self._token: bytes | None = None
        self._tls: ssl.SSLContext | None = None
        if settings.listen is not None:
            if settings.token_file is None or settings.tls_cert is None or not settings.tls_key:
                raise ConfigError(
                    "--listen needs --token-file, --tls-cert and --tls-key: the network "
                    "transport is TLS with a bearer token only"
                )
            self._token = _read_token(settings.token_file)
            self._tls = _tls_context(settings.tls_cert, settings.tls_key)

    async def start(self) -> None:
        path = self.supervisor.socket_path
        if not path.parent.exists():
            # Only a directory the daemon creates itself is narrowed to 0700; an existing
            # one (say /run) keeps the mode its owner gave it.
            path.parent.mkdir(parents=True, mode=0o700)
            os.chmod(path.parent, 0o700)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()
        old_umask = os.umask(0o177)
        try:
            unix = await asyncio.start_unix_server(
                self._serve_local, sock=unixpath.bound(path), limit=MAX_LINE_BYTES + 1
            )
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        self._servers.append(unix)
        log.info("listening endpoint=unix:%s", path)
        if self.settings.listen is not None:
            host, _, port = self.settings.listen.rpartition(":")
            try:
                # TLS is started per connection (``_serve_network``), so a connection is
                # counted against the cap from accept, handshake included.
                tcp = await asyncio.start_server(
                    self._serve_network,
                    host=host.strip("[]"),
                    port=int(port),
                    limit=MAX_LINE_BYTES + 1,
                )
            except OSError as exc:
                raise ConfigError(
                    f"cannot listen on {self.settings.listen}: {exc.strerror or exc}"
                ) from None
            self._servers.append(tcp)
            log.info("listening endpoint=tls:%s", self.settings.listen)

    def bound_port(self) -> int | None:
        """The TCP port actually bound (useful with ``--listen HOST:0``)."""
        for server in self._servers[1:]:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return None

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for connection in list(self._connections):
            connection.cancel()
        if self._connections:
            await asyncio.wait(self._connections, timeout=1.0)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        with contextlib.suppress(FileNotFoundError):
            self.supervisor.socket_path.unlink()

    async def _serve_local(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await self._serve(reader, writer)

    async def _serve_network(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None and self._tls is not None
        if len(self._network) >= MAX_NETWORK_CONNECTIONS:
            self._refusals.warning(
                "connection_refused", "reason=cap max=%d", MAX_NETWORK_CONNECTIONS
            )
            writer.transport.abort()
            return
        self._network.add(task)
        try:
            await writer.start_tls(self._tls, ssl_handshake_timeout=TLS_HANDSHAKE_SECS)
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as exc:
            self._refusals.warning("tls_handshake_failed", "error=%s", type(exc).__name__)
            self._network.discard(task)
            writer.transport.abort()
            return
        try:
            if await self._authenticated(reader):
                await self._serve(reader, writer)
            else:
                writer.transport.abort()
        finally:
            self._network.discard(task)

    async def _authenticated(self, reader: asyncio.StreamReader) -> bool:
        """Whether the connection's first line is the bearer preamble with our token."""
        assert self._token is not None
        try:
            line = await asyncio.wait_for(reader.readuntil(b"\n"), AUTH_DEADLINE_SECS)
        except TimeoutError:
            self._refusals.warning("connection_closed", "reason=no_preamble_in_time")
            return False
        except asyncio.LimitOverrunError:
            self._refusals.warning("connection_closed", "reason=preamble_too_long")
            return False
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            return False
        if len(line) > MAX_PREAMBLE_BYTES:
            self._refusals.warning("connection_closed", "reason=preamble_too_long")
            return False
        try:
            preamble = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            preamble = None
        bearer = preamble.get("bearer") if isinstance(preamble, dict) else None
        if not isinstance(bearer, str):
            self._refusals.warning("connection_closed", "reason=malformed_preamble")
            return False
        if not hmac.compare_digest(bearer.encode(), self._token):
            self._refusals.warning("connection_closed", "reason=bad_bearer_token")
            return False
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while (line := await read_request_line(reader)) is not None:
                if isinstance(line, bytes) and not line.strip():
                    continue
                reply = await self._answer(line)
                writer.write(proto.encode(reply))
                await writer.drain()
        except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, line: bytes | _LineTooLong) -> proto.Reply:
        try:
            if isinstance(line, _LineTooLong):
                raise ProtocolError(
                    ErrorKind.BAD_REQUEST, f"request line exceeds {MAX_LINE_BYTES} bytes; skipped"
                )
            request = proto.parse_request(line)
            return await self.supervisor.handle(request)
        except ProtocolError as exc:
            log.info("request_refused kind=%s message=%s", exc.kind, exc.message)
            return exc.reply()
        except Exception as exc:
            log.exception("request_failed")
            return ProtocolError(ErrorKind.INTERNAL, f"internal error: {exc}").reply()


async def run_daemon(settings: DaemonSettings) -> None:
    """Serve until SIGTERM, SIGINT or ``shutdown``; then drain every agent and exit."""
    if settings.queue is not None:  # a Sandbox pod's daemon: every record names its task
        # caliband.<namespace>.<name>, checked by the settings' pattern; a namespace has no
        # dot (contract.parse_daemon_queue would load Celery into the daemon).
        _, namespace, name = settings.queue.split(".", 2)
        set_process_context(namespace=namespace, name=name, task_uid=settings.task_uid)
    supervisor = Supervisor(settings)
    server = ControlServer(settings, supervisor)  # refuses bad settings before any disk write
    try:
        supervisor.open()  # takes the store's lock before the socket is touched
    except StoreInUse as exc:
        raise ConfigError(str(exc)) from None
    try:
        await server.start()
    except ConfigError:
        await server.close()
        raise
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, supervisor.stopping.set)
    probes = DaemonProbes(settings, supervisor) if settings.metrics_port else None
    if probes is not None:
        probes.start()
    consumer = None
    if settings.queue is not None:
        consumer = consumer_process(settings, str(supervisor.socket_path))
        if probes is not None:
            probes.watch_consumer(consumer)
        consumer.start()
    await supervisor.spawn_initial()
    log.info("daemon_ready pid=%d store=%s", os.getpid(), supervisor.store.root)
    await supervisor.stopping.wait()
    log.info("daemon_stopping drain_grace_secs=%s", settings.drain_grace_secs)
    if consumer is not None:
        consumer.request_stop()
    await supervisor.close()
    if consumer is not None:
        await consumer.wait_stopped(within=settings.drain_grace_secs + 30)
    await server.close()
    if probes is not None:
        await probes.close()
    log.info("daemon_stopped")
