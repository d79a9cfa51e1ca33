"""``drainctl dev up``: the whole system on one machine, in one foreground command.

It brings up, in order: the ledger (SQLite in the state dir unless ``DRAIN_DATABASE_URL``
says otherwise, migrated to head), the broker (``DRAIN_BROKER_URL``, or the embedded
Redis-protocol broker), the embedded Kubernetes API with the CRDs shipped as
package data (:func:`packaged_crds`) and a kubeconfig for it, the orchestrator worker and
the operator and the periodic auditor (``drainctl audit --every``; child processes,
restarted if they die), and the stand-in Sandbox controller (in process). Without
``DRAIN_BROKER_URL`` the broker is the embedded one (``orchestrator.devcluster.broker``:
fakeredis's Redis-protocol server, a child process on a free port).
Unless ``--no-snapshots``, the API also serves the CSI snapshot CRDs
(:data:`SNAPSHOT_CRDS`) and holds the default VolumeSnapshotClass, the stand-in CSI
driver's (``csi``, run by the stand-in controller), so the operator snapshots and
restores workspaces as on a cluster with CSI snapshots. With ``--no-snapshots`` it is a
cluster without them: snapshot CRDs restored from the state dir are deleted, their
objects with them, as uninstalling them would.
The API's objects are saved in ``<state-dir>/api-state.json`` (``persistence``) and
restored by the next ``dev up`` on the same state dir, as a real cluster's etcd outlives
its API server; ``--fresh`` starts with an empty API instead. A state file that cannot be
restored stops the command with one line saying so, never an empty cluster in its place.
With ``--rbac FILE`` the API authenticates bearer tokens and authorizes by RBAC
(``authz``): the objects of FILE (``deploy/base/rbac.yaml``) are applied at start, the
operator runs as the ServiceAccount ``caliban-drain-operator`` with its own kubeconfig
(:data:`OPERATOR_KUBECONFIG`), everything else (kubectl too, which sends no token over
http) as a ``system:masters`` user, who may impersonate (``kubectl auth can-i --as
system:serviceaccount:caliban-drain:caliban-drain-operator ...``); with
``--record-requests FILE`` each request's user, verb, resource and name is written to
FILE as a JSON line (tokens on, so the operator's calls are told apart).
Then a user drives it all with ``kubectl --kubeconfig FILE``. SIGTERM or Ctrl-C stops
everything, daemons drained on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import sys
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any, Final

import yaml
from kubernetes import client
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException

from orchestrator.devcluster import authz, broker, csi
from orchestrator.devcluster.apiserver import DevClusterError, EmbeddedApiServer, load_crds
from orchestrator.devcluster.kubeconfig import DEV_TOKEN, kubeconfig_document, write_kubeconfig
from orchestrator.devcluster.persistence import API_STATE_FILE, StateFileError
from orchestrator.devcluster.sandbox_controller import DAEMON_METRICS_DIR, SandboxController
from orchestrator.devcluster.store import WatchQuery
from orchestrator.ledger.migrate import upgrade
from orchestrator.operator.crd import (
    SANDBOX_CRD,
    SANDBOX_GROUP,
    SANDBOX_PLURAL,
    SNAPSHOT_CLASS_PLURAL,
    SNAPSHOT_CONTENT_PLURAL,
    SNAPSHOT_GROUP,
    SNAPSHOT_PLURAL,
    SNAPSHOT_VERSION,
)
from worker_agent import signing
from worker_agent.children import KeptProcess

log = logging.getLogger(__name__)

SANDBOXES_DIR: Final = "sandboxes"
"""The stand-in Sandbox controller's dir in the state dir: volumes, snapshot copies (the
layout below it is ``csi``'s), pods' logs and emptyDirs."""

LEDGER_FILE: Final = "ledger.db"
MESSAGE_KEY_FILE: Final = "message-key"
"""The SQLite ledger in the state dir, unless ``DRAIN_DATABASE_URL`` says otherwise."""

AUDIT_REPORT_FILE: Final = "audit-report.json"
"""The periodic auditor's latest report, in the state dir."""

METRICS_FILE: Final = "metrics.json"
"""The ``/metrics`` URLs of the stack's processes (operator, worker, audit), in the
state dir; each daemon's is in the stand-in controller's (``sandbox_controller``). The
stack picks free ports on 127.0.0.1 for all of them, whatever ``DRAIN_METRICS_PORT``
says, so stacks and daemons on one machine never collide."""

OPERATOR_KUBECONFIG: Final = "operator-kubeconfig.yaml"
"""The operator's own kubeconfig in the state dir (with ``--rbac`` or
``--record-requests``): its ServiceAccount's token."""

OPERATOR_TOKEN: Final = "caliban-drain-operator-dev"  # noqa: S105  # the dev API's own
OPERATOR_USER: Final = authz.service_account_user("caliban-drain", "caliban-drain-operator")
ADMIN_USER: Final = authz.User("caliban-drain-dev", (authz.SUPERUSER_GROUP,))


def stack_access(rbac: bool, record_requests: Path | None) -> authz.AccessControl | None:
    """The API's checks: none by default; tokens (the dev user, the operator's) with
    ``rbac`` or a record, RBAC authorization with ``rbac``."""
    if not rbac and record_requests is None:
        return None
    tokens = {DEV_TOKEN: ADMIN_USER, OPERATOR_TOKEN: OPERATOR_USER}
    # kubectl sends no bearer token over plain http: a request without one is the dev
    # user's (the operator always sends its token, so it is never taken for it).
    return authz.AccessControl(
        tokens, authorize=rbac, record_requests=record_requests, anonymous=ADMIN_USER
    )


def apply_manifests(path: Path) -> None:
    """Create the objects of ``path`` (namespaces they need first), as kubectl apply."""
    from kubernetes import utils

    try:
        documents = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    except (OSError, yaml.YAMLError) as exc:
        raise DevClusterError(f"cannot read RBAC manifests {path}: {exc}") from exc
    namespaces = {d.get("metadata", {}).get("namespace") for d in documents} - {None}
    api = client.ApiClient()
    for namespace in sorted(namespaces):
        with contextlib.suppress(ApiException):  # it exists
            client.CoreV1Api(api).create_namespace({"metadata": {"name": namespace}})
    for document in documents:
        try:
            utils.create_from_dict(api, document)
        except (utils.FailToCreateError, ValueError, AttributeError) as exc:
            raise DevClusterError(f"cannot apply {path}: {exc}") from exc


SANDBOX_CRD_FILE: Final = f"crds/agent-sandbox/{SANDBOX_GROUP}_{SANDBOX_PLURAL}.yaml"
"""agent-sandbox's Sandbox CRD (v0.5.6), copied byte for byte; its README says from where.
It stores ``v1beta1`` and serves ``v1alpha1`` deprecated, converting between them with a
webhook, which the embedded API stands in for (``conversion``)."""

SANDBOX_STORAGE_VERSIONS: Final = ("v1beta1", "v1alpha1")
"""``drainctl dev up --sandbox-storage``: ``v1beta1`` (the default) serves the CRD as
agent-sandbox ships it; ``v1alpha1`` serves it as a release before ``v1beta1`` existed
(``v1alpha1`` only, stored, no conversion)."""

PACKAGED_CRDS: Final = (
    ("orchestrator.operator", "crds/calibantask.yaml"),
    ("orchestrator.operator", "crds/workspace.yaml"),
    ("orchestrator.devcluster", SANDBOX_CRD_FILE),
)
"""The CRDs the dev stack serves, as (package, resource): the CalibanTask and Workspace
CRDs ship with the operator, agent-sandbox's Sandbox CRD with this package. They are
package data, so an installed wheel finds them wherever it runs; ``deploy/crds/`` holds
copies of the operator's two for ``kubectl apply -f`` and kustomize (which refuses
symlinks out of its root), and ``tests/integration/test_packaging.py`` keeps them
identical. The Sandbox CRD is not in ``deploy/``: a cluster installs agent-sandbox's."""

SNAPSHOT_CRDS: Final = tuple(
    ("orchestrator.devcluster", f"crds/snapshots/{SNAPSHOT_GROUP}_{plural}.yaml")
    for plural in (SNAPSHOT_PLURAL, SNAPSHOT_CLASS_PLURAL, SNAPSHOT_CONTENT_PLURAL)
)
"""The external-snapshotter's CRDs (VolumeSnapshot, -Class, -Content), copied byte for
byte (``crds/snapshots/README.md`` says from where). Served by the dev stack unless
``--no-snapshots``; never in ``deploy/crds/``, since on a cluster its CSI distribution
installs them, not this project."""


PEERING_CRDS: Final = (("orchestrator.operator", "crds/kopf-peering.yaml"),)
"""kopf's peering CRDs (ClusterKopfPeering, KopfPeering), which replicas of the operator
run with ``--peering`` share; served by the dev stack, so two operators can fail over on
it. On a cluster they come with the operator's manifests (``deploy/base``)."""


def packaged_crds(*, snapshots: bool = True) -> list[dict[str, Any]]:
    """The CRD documents of :data:`PACKAGED_CRDS` and (``snapshots``) of
    :data:`SNAPSHOT_CRDS`, read with ``importlib.resources``."""
    return _read_crds((*PACKAGED_CRDS, *(SNAPSHOT_CRDS if snapshots else ())))


def _read_crds(sources: Iterable[tuple[str, str]]) -> list[dict[str, Any]]:
    documents: list[dict[str, Any]] = []
    for package, name in sources:
        text = resources.files(package).joinpath(name).read_text(encoding="utf-8")
        documents.extend(d for d in yaml.safe_load_all(text) if d)
    return load_crds(documents)


def withdraw_snapshot_crds() -> list[str]:
    """Delete the snapshot CRDs (and with them their objects) where the API serves them,
    as uninstalling them from a cluster would; the names of those it deleted."""
    deleted = []
    for crd in _read_crds(SNAPSHOT_CRDS):
        name = str(crd["metadata"]["name"])
        try:
            client.ApiextensionsV1Api().delete_custom_resource_definition(name)
        except ApiException as exc:
            if exc.status == 404:
                continue
            raise
        deleted.append(name)
    return deleted


def stack_environment(
    state_dir: Path, kubeconfig: Path, embedded_broker_port: int | None = None
) -> dict[str, str]:
    """The environment every process of the dev stack shares; with no
    ``DRAIN_BROKER_URL``, the embedded broker on ``embedded_broker_port``."""
    env = dict(os.environ)
    env.setdefault("DRAIN_DATABASE_URL", f"sqlite:///{state_dir / LEDGER_FILE}")
    if "DRAIN_BROKER_URL" not in env:
        if embedded_broker_port is None:
            raise ValueError("no DRAIN_BROKER_URL and no embedded broker port")
        env["DRAIN_BROKER_URL"] = f"redis://{broker.HOST}:{embedded_broker_port}/0"
        env.setdefault("DRAIN_RESULT_BACKEND", env["DRAIN_BROKER_URL"])
    env["KUBECONFIG"] = str(kubeconfig)
    if "DRAIN_MESSAGE_KEY" not in env:
        env["DRAIN_MESSAGE_KEY"] = message_key(state_dir)
    env["DRAIN_METRICS_HOST"] = env["DRAIN_DAEMON_METRICS_HOST"] = broker.HOST
    env.setdefault("DRAIN_RECONCILE_INTERVAL_SECS", "1")
    env.setdefault("DRAIN_HEARTBEAT_INTERVAL_SECS", "5")
    env.setdefault("DRAIN_HEARTBEAT_POLL_SECS", "0.5")
    env.setdefault("DRAIN_UNACKED_RESTORE_INTERVAL_SECS", "2")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def message_key(state_dir: Path) -> str:
    """The stack's message key (``DRAIN_MESSAGE_KEY``), made once and kept in the state
    dir (readable by its owner only), so a restarted stack's daemons still prove
    themselves with the task keys derived from it."""
    path = state_dir / MESSAGE_KEY_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(signing.KEY_BYTES))
    return path.read_text().strip()


def stack_crds(sandbox_storage: str, *, snapshots: bool = True) -> list[dict[str, Any]]:
    """The packaged CRDs (the snapshot ones only with ``snapshots``) and kopf's peering
    CRDs, the Sandbox's served as ``sandbox_storage`` says (:data:`SANDBOX_STORAGE_VERSIONS`).

    ``v1alpha1``: a cluster whose agent-sandbox predates ``v1beta1``, which serves and
    stores ``v1alpha1`` only (the CRD's ``v1beta1`` version and webhook dropped), so a task
    there gets a ``v1alpha1`` Sandbox suspended through ``spec.replicas``.
    """
    if sandbox_storage not in SANDBOX_STORAGE_VERSIONS:
        raise ValueError(
            f"--sandbox-storage {sandbox_storage!r}: not one of {list(SANDBOX_STORAGE_VERSIONS)}"
        )
    crds = [*packaged_crds(snapshots=snapshots), *_read_crds(PEERING_CRDS)]
    for crd in crds:
        if crd["metadata"]["name"] == SANDBOX_CRD and sandbox_storage == "v1alpha1":
            spec = crd["spec"]
            spec["versions"] = [
                {
                    **{
                        k: v
                        for k, v in version.items()
                        if k not in ("deprecated", "deprecationWarning")
                    },
                    "storage": True,
                }
                for version in spec["versions"]
                if version["name"] == "v1alpha1"
            ]
            spec["conversion"] = {"strategy": "None"}
    return crds


SNAPSHOTS_KEY: Final = (SNAPSHOT_GROUP, SNAPSHOT_VERSION, SNAPSHOT_PLURAL)
PVCS_KEY: Final = ("", "v1", "persistentvolumeclaims")


async def wake_on_creation(
    api: EmbeddedApiServer, key: tuple[str, str, str], controller: SandboxController
) -> None:
    """Wake the stand-in controller's CSI driver whenever an object of ``key`` is
    created (a watch of the API's own store, in process), until the API stops; a
    resource it does not serve (``--no-snapshots``) is not watched."""
    state = api.emulator.state
    resource = state.registry.lookup(*key)
    if resource is None:
        return
    query = WatchQuery(resource, None, None)
    since = state.resource_version
    async for event in state.open_watch(query, since=since, send_initial=False, timeout=None):
        if event.get("type") == "ADDED":
            controller.wake()


async def run_dev_up(
    *,
    kubeconfig: Path,
    state_dir: Path,
    port: int,
    sandbox_storage: str = "v1beta1",
    fresh: bool = False,
    snapshots: bool = True,
    operator: bool = True,
    rbac: Path | None = None,
    record_requests: Path | None = None,
    snapshot_ready_delay_secs: float = 0.0,
) -> None:
    """Run the stack until SIGTERM/SIGINT; both paths must be absolute; ``snapshots``:
    serve CSI volume snapshots (see the module), each ``readyToUse`` only
    ``snapshot_ready_delay_secs`` after its cut; ``operator`` False: no operator (the
    user runs their own, e.g. two replicas with ``--peering``); ``rbac``,
    ``record_requests``: see the module. Raises
    :class:`DevClusterError` for what the user can fix (a state file that cannot be
    restored, a port in use)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    api_state = state_dir / API_STATE_FILE
    if fresh:
        api_state.unlink(missing_ok=True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # one line per request
    logs = state_dir / "logs"
    logs.mkdir(exist_ok=True)
    embedded_port = None if "DRAIN_BROKER_URL" in os.environ else broker.kept_port(state_dir)
    env = stack_environment(state_dir, kubeconfig, embedded_port)
    embedded: KeptProcess | None = None
    if embedded_port is not None:
        embedded = KeptProcess(
            "embedded broker",
            [sys.executable, "-m", "orchestrator.devcluster.broker", "--port", str(embedded_port)],
            env,
            logs / "broker.log",
        )
        embedded.start()
        try:
            await asyncio.to_thread(broker.wait_serving, embedded_port)
        except DevClusterError:
            embedded.request_stop()
            await embedded.wait_stopped(within=10)
            raise
    os.environ.update({k: v for k, v in env.items() if k.startswith(("DRAIN_", "KUBECONFIG"))})
    await asyncio.to_thread(upgrade, env["DRAIN_DATABASE_URL"])
    crds = stack_crds(sandbox_storage, snapshots=snapshots)
    access = stack_access(rbac is not None, record_requests)
    api = EmbeddedApiServer(port=port, crds=crds, state_file=api_state, access=access)
    try:
        await api.start()
    except StateFileError as exc:
        if embedded is not None:
            embedded.request_stop()
            await embedded.wait_stopped(within=10)
        raise DevClusterError(
            f"cannot restore the embedded Kubernetes API from {exc}; to start with an empty "
            f"API, remove {exc.path} or run drainctl dev up --fresh (the ledger and the "
            "volumes in the state dir are kept)"
        ) from None
    try:
        # The cluster is made what it should be before the kubeconfig appears (clients,
        # and DevStackProcess, wait for it), so nothing sees it half way.
        kube_config.load_kube_config_from_dict(kubeconfig_document(api.url))
        if snapshots:
            if await asyncio.to_thread(csi.ensure_snapshot_class):
                log.info(
                    "snapshot_class_created name=%s driver=%s",
                    csi.DEV_SNAPSHOT_CLASS,
                    csi.DEV_CSI_DRIVER,
                )
        else:
            for name in await asyncio.to_thread(withdraw_snapshot_crds):
                log.warning("crd_removed name=%s reason=--no-snapshots (its objects with it)", name)
        if rbac is not None:
            await asyncio.to_thread(apply_manifests, rbac)
        operator_env = env
        if access is not None:
            own = write_kubeconfig(state_dir / OPERATOR_KUBECONFIG, api.url, token=OPERATOR_TOKEN)
            operator_env = {**env, "KUBECONFIG": str(own)}
        write_kubeconfig(kubeconfig, api.url)
        cli = [sys.executable, "-m", "orchestrator.cli"]
        served = {"operator": broker.free_port(), "worker": broker.free_port()}
        worker = KeptProcess(
            "orchestrator worker",
            [*cli, "worker", "--metrics-port", str(served["worker"])],
            env,
            logs / "worker.log",
        )
        operator_env = {**operator_env, "DRAIN_METRICS_PORT": str(served["operator"])}
        operator_process = KeptProcess(
            "operator",
            [*cli, "operator", "--manage-sandbox"],
            operator_env,
            logs / "operator.log",
        )
        controller = SandboxController(
            state_dir / SANDBOXES_DIR, env=env, snapshot_ready_delay_secs=snapshot_ready_delay_secs
        )
        metrics_port = served["audit"] = broker.free_port()
        urls = {what: f"http://{broker.HOST}:{port}/metrics" for what, port in served.items()}
        (state_dir / METRICS_FILE).write_text(json.dumps(urls, indent=2) + "\n")
        auditor = KeptProcess(
            "auditor",
            [
                *cli,
                "audit",
                "--every",
                env.get("DRAIN_AUDIT_INTERVAL_SECS", "60"),
                "--volumes",
                str(state_dir / SANDBOXES_DIR),
                "--metrics-port",
                str(metrics_port),
                "--report-file",
                str(state_dir / AUDIT_REPORT_FILE),
            ],
            env,
            logs / "audit.log",
        )
        worker.start()
        if operator:
            operator_process.start()
        auditor.start()
        controller_task = asyncio.get_running_loop().create_task(controller.run())
        wakers = [
            asyncio.get_running_loop().create_task(wake_on_creation(api, key, controller))
            for key in (SNAPSHOTS_KEY, PVCS_KEY)
        ]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        ready = (
            f"readyToUse {snapshot_ready_delay_secs:g}s after the cut"
            if snapshot_ready_delay_secs > 0
            else "readyToUse at the cut"
        )
        snapshot_line = (
            f"VolumeSnapshotClass {csi.DEV_SNAPSHOT_CLASS} (the default; {ready}); snapshot "
            f"copies in {state_dir / SANDBOXES_DIR / csi.SNAPSHOTS_DIR}"
            if snapshots
            else "no CSI volume snapshots (--no-snapshots)"
        )
        print(
            f"caliban-drain dev stack up\n"
            f"  kubectl --kubeconfig {kubeconfig} get ctask -A\n"
            f"  Kubernetes API {api.url}; ledger {env['DRAIN_DATABASE_URL']}; "
            f"broker {env['DRAIN_BROKER_URL']}\n"
            f"  logs in {logs}; volumes in {state_dir / SANDBOXES_DIR / csi.VOLUMES_DIR}\n"
            f"  {snapshot_line}\n"
            f"  metrics: operator {urls['operator']}, worker {urls['worker']} (also /healthz, "
            f"/readyz), daemons' in {state_dir / SANDBOXES_DIR / DAEMON_METRICS_DIR}\n"
            f"  audit every {env.get('DRAIN_AUDIT_INTERVAL_SECS', '60')}s: report "
            f"{state_dir / AUDIT_REPORT_FILE}, metrics http://127.0.0.1:{metrics_port}/metrics; "
            f"now: DRAIN_DATABASE_URL={env['DRAIN_DATABASE_URL']} drainctl audit --kubeconfig "
            f"{kubeconfig} --volumes {state_dir / SANDBOXES_DIR}",
            flush=True,
        )
        try:
            await stop.wait()
        finally:
            log.info("dev_stack_stopping")
            auditor.request_stop()
            if operator:
                operator_process.request_stop()
                await operator_process.wait_stopped(within=30)
            await auditor.wait_stopped(within=30)
            controller.stopping.set()
            for waker in wakers:
                waker.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await controller_task
            worker.request_stop()
            await worker.wait_stopped(within=30)
            if embedded is not None:
                embedded.request_stop()
                await embedded.wait_stopped(within=10)
    finally:
        await api.stop()
