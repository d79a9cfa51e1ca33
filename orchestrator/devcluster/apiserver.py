"""The embedded Kubernetes API as a server: ``drainctl dev cluster`` and test fixtures.

:class:`EmbeddedApiServer` puts a :class:`~orchestrator.devcluster.emulator.DevClusterEmulator`
on a loopback TCP port with aiohttp's low-level server, seeds the ``default`` and
``kube-system`` namespaces and any CRDs it is given, and stops cleanly (open watches end
first). Given a ``state_file``, it restores the objects saved there before it seeds (a
seeded namespace that exists stays; a given CRD replaces the stored one, so an upgrade
takes effect) and keeps the file saved (``persistence``).

kmock's own ``kmock.Server`` is not used: it is built for tests, with a client session
and a process-wide patch of aiohttp's DNS resolution, which a long-running server that
shares its process with kopf must not have. :func:`run_dev_cluster` is the
foreground command: serve, write the kubeconfig, wait for SIGTERM or SIGINT.

There is no authentication unless ``access`` asks for it (``authz``: bearer tokens,
RBAC, a record of every request); it listens on 127.0.0.1 unless a caller asks otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import signal
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiohttp.web
import kmock
import yaml

from orchestrator.devcluster import persistence, resources
from orchestrator.devcluster.authz import AccessControl
from orchestrator.devcluster.emulator import DevClusterEmulator
from orchestrator.devcluster.kubeconfig import write_kubeconfig
from orchestrator.devcluster.store import ClusterState

__all__ = [
    "DevClusterError",
    "EmbeddedApiServer",
    "load_crds",
    "run_dev_cluster",
    "serve_dev_cluster",
    "write_kubeconfig",  # re-exported: callers that start a server usually write one too
]

log = logging.getLogger(__name__)

CrdSource = Path | str | Mapping[str, Any]
SEEDED_NAMESPACES = ("default", "kube-system")


class DevClusterError(Exception):
    """Something a user can fix (a port in use, a bad CRD file); the message says what."""


def load_crds(sources: Iterable[CrdSource]) -> list[dict[str, Any]]:
    """CRDs from YAML files (several documents each allowed) or ready dicts."""
    crds: list[dict[str, Any]] = []
    for source in sources:
        if isinstance(source, Mapping):
            crds.append(dict(source))
            continue
        path = Path(source)
        try:
            documents = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
        except (OSError, yaml.YAMLError) as exc:
            raise DevClusterError(f"cannot read CRD file {path}: {exc}") from exc
        for document in documents:
            if not isinstance(document, dict) or document.get("kind") != "CustomResourceDefinition":
                kind = (
                    document.get("kind") if isinstance(document, dict) else type(document).__name__
                )
                raise DevClusterError(
                    f"{path} holds a {kind}, not a CustomResourceDefinition; pass only CRD files"
                )
            crds.append(document)
    return crds


class EmbeddedApiServer:
    """An in-process Kubernetes API on ``host:port`` (0: any free port); see the module."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        crds: Iterable[CrdSource] = (),
        *,
        state_file: Path | None = None,
        access: AccessControl | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.emulator = DevClusterEmulator(access=access)
        self.state_file = state_file
        self._crds = load_crds(crds)
        self._runner: aiohttp.web.ServerRunner | None = None
        self._saver: persistence.StateSaver | None = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the embedded API server is not started")
        return self._url

    @property
    def objects(self) -> kmock.ObjectsArray:
        """kmock's view of every stored object, for assertions."""
        return self.emulator.objects

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("the embedded API server is already started")
        await self.emulator.__aenter__()
        try:
            if self.state_file is not None and self.state_file.exists():
                self._restore(self.state_file)
            self._seed()
            sock = self._listen()
            server = aiohttp.web.Server(self.emulator, handler_cancellation=True)
            runner = aiohttp.web.ServerRunner(server, shutdown_timeout=2.0)
            await runner.setup()
            await aiohttp.web.SockSite(runner, sock).start()
        except BaseException:
            await self.emulator.__aexit__(None, None, None)
            raise
        self._runner = runner
        if self.state_file is not None:
            self._saver = persistence.StateSaver(self.emulator.state, self.state_file)
            self._saver.start()
        host, port = sock.getsockname()[:2]
        self._url = f"http://{host}:{port}"
        log.info("embedded api listening url=%s", self._url)

    async def stop(self) -> None:
        if self._runner is None:
            return
        self.emulator.state.close()  # ends open watches, so the shutdown does not wait on them
        runner, self._runner = self._runner, None
        await runner.cleanup()
        if self._saver is not None:
            await self._saver.close()  # after the last request, so the file has it
            self._saver = None
        await self.emulator.__aexit__(None, None, None)
        log.info("embedded api stopped url=%s", self._url)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()

    def _restore(self, path: Path) -> None:
        started = time.monotonic()
        snapshot = persistence.restore(self.emulator.state, path)
        log.info(
            "embedded api restored path=%s objects=%d resource_version=%s secs=%.3f",
            path,
            len(snapshot.objects),
            self.emulator.state.resource_version,
            time.monotonic() - started,
        )

    def _seed(self) -> None:
        """The seeded namespaces where missing, and the given CRDs created or, when a
        restored one has the name, put in its place (its finalizers kept)."""
        state = self.emulator.state
        namespaces = state.registry.lookup(*resources.NAMESPACES)
        crds = state.registry.lookup(*resources.CRDS)
        assert namespaces is not None and crds is not None  # built-ins
        for name in SEEDED_NAMESPACES:
            if not _exists(state, namespaces, name):
                state.create(namespaces, None, {"metadata": {"name": name}})
        for crd in self._crds:
            name = str(crd.get("metadata", {}).get("name"))
            try:
                if not _exists(state, crds, name):
                    state.create(crds, None, crd)
                    continue
                stored = state.get(crds, None, name)
                if stored["metadata"].get("deletionTimestamp"):
                    log.warning("crd not replaced name=%s reason=being-deleted", name)
                    continue
                replacement = copy.deepcopy(crd)
                meta = replacement.setdefault("metadata", {})
                meta["finalizers"] = stored["metadata"].get("finalizers") or []
                state.replace(crds, None, name, replacement)
            except kmock.KubernetesError as exc:
                raise DevClusterError(f"CRD {name} cannot be served: {exc.message}") from exc

    def _listen(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise DevClusterError(
                f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}; "
                "pick another --port (0 picks a free one)"
            ) from exc
        return sock


def _exists(state: ClusterState, resource: resources.ServedResource, name: str) -> bool:
    try:
        state.get(resource, None, name)
    except kmock.KubernetesError:
        return False
    return True


async def serve_dev_cluster(
    port: int,
    kubeconfig: Path,
    crd_files: Iterable[CrdSource],
    *,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until ``stop`` is set or SIGTERM/SIGINT arrives; the kubeconfig is written
    once the server listens."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(signum, stop.set)
            handled.append(signum)
    try:
        async with EmbeddedApiServer(port=port, crds=crd_files) as server:
            write_kubeconfig(kubeconfig, server.url)
            log.info("dev cluster ready url=%s kubeconfig=%s", server.url, kubeconfig)
            if on_ready is not None:
                on_ready(server.url)
            await stop.wait()
            log.info("dev cluster stopping url=%s", server.url)
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)


def run_dev_cluster(
    port: int,
    kubeconfig: Path,
    crd_files: Sequence[CrdSource],
    *,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """``drainctl dev cluster``: the embedded API in the foreground until SIGTERM/SIGINT.
    Raises :class:`DevClusterError` for what the user can fix."""
    asyncio.run(serve_dev_cluster(port, kubeconfig, crd_files, on_ready=on_ready))
