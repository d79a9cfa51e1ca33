"""``drainctl dev controller``: the stand-in Sandbox controller and CSI driver, attached
to a Kubernetes API that runs elsewhere.

``drainctl dev up`` runs the stand-in controller (``sandbox_controller``) in its own
process, beside the API it starts. Here the API is another process's — ``drainctl dev
cluster`` in another container of the compose stack — so this command first waits for
that API's kubeconfig to appear and for the API to answer (the two may start in any
order, and either may restart), then, where the API serves the CSI snapshot CRDs,
creates the stand-in driver's default VolumeSnapshotClass (``csi.ensure_snapshot_class``,
as ``dev up`` does, so the operator's snapshots are cut instead of waiting out
``DRAIN_SNAPSHOT_CUT_TIMEOUT_SECS``), and runs the controller until SIGTERM or SIGINT:
its daemons stopped on the way out, as a node's pods are.

Failures a user can fix are :class:`DevClusterError`: a state dir that is not a
directory, a kubeconfig that never appears or cannot be read, an API that never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from pathlib import Path

import yaml
from kubernetes import client
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from orchestrator.devcluster import csi
from orchestrator.devcluster.apiserver import DevClusterError
from orchestrator.devcluster.sandbox_controller import SandboxController
from orchestrator.operator.crd import SNAPSHOT_CLASS_PLURAL, SNAPSHOT_GROUP, SNAPSHOT_VERSION

log = logging.getLogger(__name__)

POLL_SECS = 0.5
"""How often the kubeconfig and the API are looked for while waiting for them."""


def check_state_dir(state_dir: Path) -> None:
    """Refuse a state dir that exists and is not a directory, or cannot be created."""
    if state_dir.exists() and not state_dir.is_dir():
        raise DevClusterError(f"--state-dir {state_dir} is not a directory; pick a directory")
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DevClusterError(
            f"--state-dir {state_dir} cannot be created: {exc.strerror or exc}"
        ) from None


def wait_for_api(kubeconfig: Path, within: float, stopping: threading.Event) -> str | None:
    """Wait up to ``within`` seconds for ``kubeconfig`` to appear and its API to answer;
    load it as the client's configuration and return the API's URL (None: ``stopping``
    was set first)."""
    deadline = time.monotonic() + within
    last = f"{kubeconfig} does not exist yet"
    while not stopping.is_set():
        if kubeconfig.is_dir():
            raise DevClusterError(f"--kubeconfig {kubeconfig} is a directory, not a kubeconfig")
        if kubeconfig.exists():
            try:
                kube_config.load_kube_config(config_file=str(kubeconfig))
            except (
                yaml.YAMLError,
                ConfigException,
                OSError,
                ValueError,
                TypeError,
                AttributeError,
            ) as exc:
                reason = " ".join(str(exc).split())
                raise DevClusterError(
                    f"--kubeconfig {kubeconfig} cannot be read as a kubeconfig: {reason}"
                ) from None
            probe = client.Configuration.get_default_copy()
            probe.retries = 0  # this loop is the retry; urllib3's would log each attempt
            try:
                with client.ApiClient(probe) as api:
                    client.VersionApi(api).get_code(_request_timeout=5)
                return str(probe.host)
            except Exception as exc:  # any failure to answer is waited out, then reported
                last = f"the Kubernetes API at {probe.host} does not answer ({type(exc).__name__})"
        if time.monotonic() >= deadline:
            raise DevClusterError(
                f"gave up after {within:g}s: {last}; start the API (drainctl dev cluster "
                f"--kubeconfig {kubeconfig}) or raise --wait"
            )
        stopping.wait(POLL_SECS)
    return None


def snapshots_served() -> bool:
    """Whether the API serves VolumeSnapshotClasses (the CSI snapshot CRDs)."""
    try:
        client.CustomObjectsApi().list_cluster_custom_object(
            SNAPSHOT_GROUP, SNAPSHOT_VERSION, SNAPSHOT_CLASS_PLURAL
        )
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


async def run_attached_controller(state_dir: Path, kubeconfig: Path, *, wait_secs: float) -> None:
    """Run until SIGTERM/SIGINT; ``state_dir``: volumes, snapshot copies, pods' logs (the
    layout is ``sandbox_controller``'s and ``csi``'s, as under ``dev up``'s state dir)."""
    check_state_dir(state_dir)
    stop = asyncio.Event()
    stopping = threading.Event()  # the same signal, for the thread that waits for the API
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        stop.set()
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    url = await asyncio.to_thread(wait_for_api, kubeconfig, wait_secs, stopping)
    if url is None:
        log.info("dev_controller_stopped_before_api kubeconfig=%s", kubeconfig)
        return
    if await asyncio.to_thread(snapshots_served):
        if await asyncio.to_thread(csi.ensure_snapshot_class):
            log.info(
                "snapshot_class_created name=%s driver=%s",
                csi.DEV_SNAPSHOT_CLASS,
                csi.DEV_CSI_DRIVER,
            )
    else:
        log.warning("snapshots_not_served api=%s reason=no VolumeSnapshotClass CRD", url)
    controller = SandboxController(state_dir)
    log.info("dev_controller_running api=%s state_dir=%s", url, state_dir)
    running = loop.create_task(controller.run())
    await stop.wait()
    log.info("dev_controller_stopping")
    controller.stopping.set()
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await running
