"""A local stand-in for the agent-sandbox controller, so Sandboxes act like pods.

For development and tests only (a cluster runs the real controller). It watches
Sandboxes (``agents.x-k8s.io``, through the CRD's storage version, as the real controller
does) and PVCs through the Kubernetes API and keeps one real process per running Sandbox:

- a Sandbox that should run (``operatingMode: Running`` at v1beta1, ``replicas: 1`` at
  v1alpha1; written at the other version, the API's conversion carries it over) gets its pod
  template's first container started as a local process; ``drainctl`` resolves to this
  interpreter's ``orchestrator.cli``, and every volume mount path in the arguments is
  replaced by a local directory: a PVC's directory under ``<state>/volumes`` (it outlives
  the process, like a volume) or a per-Sandbox directory for an ``emptyDir``;
- the pod template's ``initContainers`` run first, one after another, each as a local
  process run to completion (its mounts and ``env`` resolved like the container's); one
  that exits non-zero keeps the pod from starting (a Warning Event
  ``InitContainerFailed`` on the Sandbox) and runs again after ``INIT_BACKOFF_SECS``,
  like a pod in ``Init:CrashLoopBackOff``; a mount's ``subPath`` is honoured;
- each such process runs under ``worker_agent.reaper``, which plays the container's
  init: the pod's whole process tree (the daemon, its consumer, its agents, in sessions
  of their own) goes when the container's process exits, and at once when this
  controller's process dies however it dies (``PR_SET_PDEATHSIG``), like the pods of a
  lost node, so a SIGKILLed ``drainctl dev up`` leaves no agent writing a workspace;
- the container's ``env`` is resolved as kubelet does: literal values, and
  ``valueFrom.secretKeyRef`` from the Secrets stored in the Sandbox's namespace (``data``
  base64, ``stringData`` as given); a Secret or key that is not there keeps the pod from
  starting, with a Warning Event ``CreateContainerConfigError`` on the Sandbox naming it
  (never a value), tried again every poll;
- a Sandbox suspended or deleted gets SIGTERM (the container's graceful stop), then the
  whole tree is killed after its ``terminationGracePeriodSeconds``;
- a PVC directory is removed only when the PVC object is gone.

It also plays the cluster's CSI driver and external-snapshotter (``csi``, called at the
start of every poll): a VolumeSnapshot of a PVC whose class is the stand-in driver's
(``dev.caliban-drain.io/hostpath``, the class ``drainctl dev up`` creates) becomes a
copy of the PVC's directory under ``<state>/snapshots/<snapshot uid>``, taken atomically
and never changed again, with its VolumeSnapshotContent, cut at once and ``readyToUse:
true`` then or, with ``snapshot_ready_delay_secs``, that long after its cut; a PVC
whose ``dataSource`` is such a snapshot gets a copy of it as its directory, and a pod that
mounts that PVC is not started (it waits, like a Pending pod) until the copy is in
place; a snapshot deleted takes its copy with it.

It polls (every ``interval``) instead of watching: a level-triggered loop that converges
whatever it missed, which is all a stand-in needs. Between polls, :meth:`SandboxController.
wake` (``drainctl dev up`` calls it when a VolumeSnapshot or a PVC is created) has the CSI
driver converge at once, as the external-snapshotter reacts to its watch: a deletion or a
pause waits for its snapshot, and a poll's interval was most of that wait.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from orchestrator.devcluster import csi
from orchestrator.devcluster.broker import free_port
from orchestrator.operator.crd import (
    SANDBOX_CRD,
    SANDBOX_GROUP,
    SANDBOX_PLURAL,
    sandbox_suspended,
)
from worker_agent import reaper
from worker_agent.children import dying_with_this_process
from worker_agent.contract import is_tenant_url

log = logging.getLogger(__name__)

KILL_TREE_SECS = 10.0
"""How long a pod's reaper has to kill its tree before it is SIGKILLed itself."""


MERGE_PATCH = "application/merge-patch+json"
POD_LABEL = "dev.caliban-drain.io/stand-in-pod"
"""On the Pod objects this controller keeps in the API for its processes."""
POD_FINALIZER = "dev.caliban-drain.io/process"
"""Holds a Pod object while its process runs: a deleted pod is Terminating until then."""


@dataclass
class Pod:
    key: str
    process: asyncio.subprocess.Process
    grace_secs: float
    claims: set[tuple[str, str]]
    stopping: bool = False
    manifest: dict[str, Any] | None = None
    """The Pod object shown in the API while the process lives."""


def pod_manifest(sandbox: dict[str, Any], pod_spec: dict[str, Any]) -> dict[str, Any]:
    """The Pod object a Sandbox's process is shown as, as the real controller's pod is:
    owned by the Sandbox (so it is garbage-collected with it), with the pod template's
    labels, annotations and volumes, and a finalizer this controller removes once the process has
    exited, so a pod whose Sandbox is gone stays Terminating while its process drains.
    Who mounts a PVC is read from these, as on a cluster."""
    meta = sandbox["metadata"]
    template = (sandbox.get("spec") or {}).get("podTemplate") or {}
    template_meta = template.get("metadata") or {}
    labels = {**(template_meta.get("labels") or {}), POD_LABEL: "true"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            # A re-created Sandbox of the same name gets another pod, as a real one does.
            "name": f"{meta['name'][:240]}-{str(meta['uid'])[:5]}",
            "namespace": meta["namespace"],
            "labels": labels,
            "annotations": dict(template_meta.get("annotations") or {}),
            "finalizers": [POD_FINALIZER],
            "ownerReferences": [{
                "apiVersion": sandbox["apiVersion"], "kind": sandbox.get("kind", "Sandbox"),
                "name": meta["name"], "uid": meta["uid"], "controller": True,
                "blockOwnerDeletion": True,
            }],
        },
        "spec": {
            "containers": [{"name": c.get("name", "main"), "image": c.get("image", "")}
                           for c in pod_spec.get("containers") or []],
            "volumes": pod_spec.get("volumes") or [],
        },
    }  # fmt: skip


CONFIG_ERROR = "CreateContainerConfigError"
"""The reason kubelet gives a container whose environment names a Secret or key that is
not there; the stand-in gives its Sandbox's pod the same, as a Warning Event."""


INIT_FAILED = "InitContainerFailed"
"""The reason of the stand-in's Warning Event when an init container exits non-zero."""
INIT_BACKOFF_SECS = 10.0
"""How long a pod whose init container failed waits before it is run again."""


class ContainerConfigError(Exception):
    """A container's ``env`` cannot be resolved (kubelet's ``CreateContainerConfigError``);
    the message names the Secret and key, never a value."""


SecretReader = Callable[[str, str], dict[str, str] | None]
"""(namespace, name) → the Secret's decoded data (``data`` and ``stringData``), or None."""


def secret_values(secret: dict[str, Any]) -> dict[str, str]:
    """A stored Secret's values: ``data`` base64-decoded, then ``stringData`` over it (the
    API merges it into ``data`` on write; the embedded API stores it as given)."""
    values = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    values.update({k: str(v) for k, v in (secret.get("stringData") or {}).items()})
    return values


def container_env(namespace: str, container: dict[str, Any], read: SecretReader) -> dict[str, str]:
    """The environment a container's ``env`` gives it: literal values, and values from
    Secrets in ``namespace`` through ``valueFrom.secretKeyRef`` (an ``optional`` one that
    is missing is left out, as kubelet does). Other ``valueFrom`` sources are ignored."""
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item:
            env[name] = str(item["value"])
            continue
        ref = (item.get("valueFrom") or {}).get("secretKeyRef")
        if ref is None:
            continue
        secret, key = ref.get("name", ""), ref.get("key", "")
        values = read(namespace, secret)
        if values is None or key not in values:
            if ref.get("optional"):
                continue
            if values is None:
                raise ContainerConfigError(f'secret "{secret}" not found')
            raise ContainerConfigError(f"couldn't find key {key} in Secret {namespace}/{secret}")
        env[name] = values[key]
    return env


def read_secret(namespace: str, name: str) -> dict[str, str] | None:
    """Secret ``namespace/name`` from the API, decoded; None when there is none."""
    try:
        found = client.CoreV1Api().read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return secret_values({"data": found.data, "stringData": found.string_data})


def container_mounts(
    container: dict[str, Any], volumes: dict[str, Any]
) -> dict[str, tuple[str, str | None, str]]:
    """A container's mount paths → (volume name, its PVC if it is one, subPath)."""
    mounted: dict[str, tuple[str, str | None, str]] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount.get("name"), {})
        claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        mounted[mount["mountPath"]] = (mount["name"], claim, mount.get("subPath") or "")
    return mounted


def pod_event(sandbox: dict[str, Any], reason: str, message: str) -> dict[str, Any]:
    """The Warning Event on the Sandbox for a pod that cannot start, as kubelet posts on a
    pod (``Error: <why>``): ``CreateContainerConfigError``, or ``InitContainerFailed``."""
    meta = sandbox["metadata"]
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name'][:200]}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": sandbox["apiVersion"], "kind": sandbox.get("kind", "Sandbox"),
            "name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"],
        },
        "reason": reason, "message": f"Error: {message}", "type": "Warning",
        "source": {"component": "stand-in-sandbox-controller"},
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }  # fmt: skip


def should_run(version: str, sandbox: dict[str, Any]) -> bool:
    """Whether a Sandbox read at ``version`` (``v1alpha1`` or ``v1beta1``) wants its pod:
    not being deleted, and not suspended by that version's field."""
    if sandbox.get("metadata", {}).get("deletionTimestamp"):
        return False
    return not sandbox_suspended(f"{SANDBOX_GROUP}/{version}", sandbox)


def sandbox_status(
    name: str, namespace: str, ready: tuple[str, str, str], *, running: bool, version: str
) -> dict[str, Any]:
    """A Sandbox's ``status`` at ``version``: its ``Ready`` condition (status, reason,
    message), the FQDN of the headless Service the real controller makes for it, and at
    v1alpha1 how many pods run (v1beta1 has no ``status.replicas``)."""
    status, reason, message = ready
    replicas = {"replicas": 1 if running else 0} if version == "v1alpha1" else {}
    return {
        "serviceFQDN": f"{name}.{namespace}.svc.cluster.local",
        "service": name,
        **replicas,
        "conditions": [{
            "type": "Ready", "status": status, "reason": reason, "message": message,
            "lastTransitionTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "observedGeneration": 0,
        }],
    }  # fmt: skip


DAEMON_METRICS_DIR = "daemon-metrics"
"""Where each pod's daemon's ``/metrics`` URL is written, one file per Sandbox
(``<namespace>.<name>``), rewritten when its pod is started again."""


def empty_dir(state_dir: Path, sandbox_uid: str, volume: str) -> Path:
    """The directory that is emptyDir ``volume`` of Sandbox ``sandbox_uid``'s pod (where
    the daemon's control socket is, for a user who talks to it directly). Per pod: a
    re-created Sandbox never shares its old socket dir."""
    return state_dir / "run" / sandbox_uid[:13] / volume


CONTROL_PLANE_ONLY: Final = frozenset({"DRAIN_MESSAGE_KEY", "DRAIN_BROKER_ADMIN_URL"})
"""What the stack's processes hold and no pod may inherit: the message key (a pod has its
task's key) and the broker's admin connection (a pod has its namespace's user)."""


def pod_environment(inherited: Mapping[str, str], container: Mapping[str, str]) -> dict[str, str]:
    """A pod's process environment: the stack's (this machine stands in for the node),
    but for what is the control plane's alone, under the container's own. A pod given a
    tenant's broker user (``contract.is_tenant_url``) keeps its results there too, as a
    real pod does (it has no result backend of its own), not in the stack's backend."""
    env = {k: v for k, v in inherited.items() if k not in CONTROL_PLANE_ONLY}
    env.update(container)
    if is_tenant_url(env.get("DRAIN_BROKER_URL", "")) and "DRAIN_RESULT_BACKEND" not in container:
        env.pop("DRAIN_RESULT_BACKEND", None)
    return env


class SandboxController:
    def __init__(
        self,
        state_dir: Path,
        interval: float = 0.3,
        env: dict[str, str] | None = None,
        *,
        snapshot_ready_delay_secs: float = 0.0,
    ):
        self.state_dir = state_dir
        self.interval = interval
        self.env = env or {}
        self.pods: dict[str, Pod] = {}
        self.stopping = asyncio.Event()
        self.woken = asyncio.Event()
        self.driver = csi.HostPathDriver(state_dir, snapshot_ready_delay_secs)
        self._waiting: dict[str, str] = {}  # Sandbox uid → why its pod waits, logged once
        self._reported: dict[str, dict[str, Any]] = {}  # Sandbox uid → the status written
        self._init_backoff: dict[str, float] = {}  # Sandbox uid → when its init may rerun

    def volume_dir(self, namespace: str, claim: str) -> Path:
        return csi.volume_dir(self.state_dir, namespace, claim)

    def empty_dir(self, sandbox_uid: str, volume: str) -> Path:
        return empty_dir(self.state_dir, sandbox_uid, volume)

    async def run(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            while not self.stopping.is_set():
                try:
                    await self.converge()
                except Exception:  # one bad poll must not stop the pods' lifecycle
                    log.exception("sandbox_controller_poll_failed")
                next_poll = time.monotonic() + self.interval
                while await self._woken_before(next_poll):
                    await self.converge_volumes()
        finally:
            await asyncio.gather(*(self.stop_pod(key) for key in list(self.pods)))

    def wake(self) -> None:
        """Have the CSI driver converge now rather than at the next poll (a snapshot or a
        PVC was created); wakes during a pass give one more pass after it."""
        self.woken.set()

    async def _woken_before(self, deadline: float) -> bool:
        """Whether :meth:`wake` came before ``deadline`` (False: the poll is due, or the
        controller is stopping)."""
        stopping = asyncio.ensure_future(self.stopping.wait())
        woken = asyncio.ensure_future(self.woken.wait())
        try:
            await asyncio.wait(
                {stopping, woken},
                timeout=max(deadline - time.monotonic(), 0),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            stopping.cancel()
            woken.cancel()
        if self.stopping.is_set() or not self.woken.is_set():
            return False
        self.woken.clear()
        return True

    async def converge_volumes(self) -> None:
        """The CSI driver's pass alone: snapshots taken, restores filled, PVCs bound."""
        try:
            await asyncio.to_thread(self.driver.converge)
        except Exception:
            log.exception("csi_driver_poll_failed")

    async def converge(self) -> None:
        self.woken.clear()  # this pass is the driver's too
        # Volumes and snapshots must not hold up the pods' lifecycle: failures are logged.
        await self.converge_volumes()
        wanted: dict[str, tuple[str, dict[str, Any]]] = {}
        # Every version serves the same stored objects, so each is read through the storage
        # version only, as the real controller does (a suspension written at the other
        # version reaches it through the API's conversion).
        version = await asyncio.to_thread(self._storage_version)
        listed = [] if version is None else await asyncio.to_thread(self._list_sandboxes, version)
        for sandbox in listed:
            # Keyed by uid: a Sandbox re-created under the same name is another pod.
            if version is not None and should_run(version, sandbox):
                wanted[str(sandbox["metadata"]["uid"])] = (version, sandbox)
        for key in list(self.pods):
            pod = self.pods[key]
            if key not in wanted and not pod.stopping:
                asyncio.get_running_loop().create_task(self.stop_pod(key))
            elif pod.process.returncode is not None and not pod.stopping:
                log.warning(
                    "sandbox_pod_exited sandbox=%s exit=%s", pod.key, pod.process.returncode
                )
                del self.pods[key]  # restarted below, like a pod's restartPolicy: Always
        for key, (_, sandbox) in wanted.items():
            if key not in self.pods:
                await self.start_pod(key, sandbox)
        for key in set(self._waiting) - set(wanted):
            del self._waiting[key]
        for key in set(self._init_backoff) - set(wanted):
            del self._init_backoff[key]
        if version is not None:
            await self.report_status(version, listed, set(wanted))
        await self.collect_volumes()
        await asyncio.to_thread(
            self.sync_pod_objects,
            [p.manifest for p in self.pods.values() if p.manifest is not None],
        )

    async def report_status(
        self, version: str, sandboxes: list[dict[str, Any]], wanted: set[str]
    ) -> None:
        """Each Sandbox's status as the real controller writes it: ``Ready`` (True while
        its pod's process runs; False, saying why, while it waits or is suspended),
        ``serviceFQDN`` and, at v1alpha1, ``replicas``; written only when it changes."""
        for sandbox in sandboxes:
            meta = sandbox["metadata"]
            key = str(meta["uid"])
            if meta.get("deletionTimestamp"):
                continue
            pod = self.pods.get(key)
            if key not in wanted:
                ready = ("False", "SandboxSuspended", "the Sandbox is suspended: no pod runs")
            elif pod is not None and pod.process.returncode is None:
                ready = ("True", "DependenciesReady", "the pod is running")
            else:
                waiting = self._waiting.get(key) or "the pod is starting"
                ready = ("False", "DependenciesNotReady", waiting)
            status = sandbox_status(
                meta["name"], meta["namespace"], ready, running=pod is not None, version=version
            )
            if self._reported.get(key) == status:
                continue
            try:
                await asyncio.to_thread(
                    client.CustomObjectsApi().patch_namespaced_custom_object_status,
                    SANDBOX_GROUP,
                    version,
                    meta["namespace"],
                    SANDBOX_PLURAL,
                    meta["name"],
                    {"status": status},
                )
            except ApiException as exc:
                if exc.status != 404:  # gone since it was listed
                    raise
                continue
            self._reported[key] = status
        for key in set(self._reported) - {str(s["metadata"]["uid"]) for s in sandboxes}:
            del self._reported[key]

    @staticmethod
    def _storage_version() -> str | None:
        try:
            crd = client.ApiextensionsV1Api().read_custom_resource_definition(SANDBOX_CRD)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        for version in crd.spec.versions:
            if version.storage:
                return str(version.name)
        return None

    @staticmethod
    def _list_sandboxes(version: str) -> list[dict[str, Any]]:
        try:
            listed = client.CustomObjectsApi().list_cluster_custom_object(
                SANDBOX_GROUP, version, SANDBOX_PLURAL
            )
        except ApiException as exc:
            if exc.status == 404:
                return []
            raise
        items: list[dict[str, Any]] = listed.get("items", [])
        return items

    async def start_pod(self, key: str, sandbox: dict[str, Any]) -> None:
        namespace = sandbox["metadata"]["namespace"]
        name = sandbox["metadata"]["name"]
        pod_spec = (sandbox.get("spec", {}).get("podTemplate") or {}).get("spec") or {}
        containers = pod_spec.get("containers") or []
        if not containers:
            log.warning("sandbox_without_container sandbox=%s", key)
            return
        container = containers[0]
        inits = pod_spec.get("initContainers") or []
        volumes = {v["name"]: v for v in pod_spec.get("volumes", []) if "name" in v}
        claims = {
            (namespace, claim)
            for c in (container, *inits)
            for _, claim, _ in container_mounts(c, volumes).values()
            if claim
        }
        for _, claim in sorted(claims):
            blocker = await asyncio.to_thread(self.driver.mount_blocker, namespace, claim)
            if blocker is not None:
                if self._waiting.get(key) != blocker:
                    self._waiting[key] = blocker
                    log.info(
                        "sandbox_pod_waiting sandbox=%s/%s pvc=%s reason=%r",
                        namespace,
                        name,
                        claim,
                        blocker,
                    )
                return  # like a Pending pod: tried again on the next poll
        try:
            environments = [
                await asyncio.to_thread(container_env, namespace, c, read_secret)
                for c in (*inits, container)
            ]
        except ContainerConfigError as exc:
            await self._pod_waits(key, sandbox, CONFIG_ERROR, str(exc))
            return  # like a pod in CreateContainerConfigError: tried again on the next poll
        if self._init_backoff.get(key, 0.0) > time.monotonic():
            return
        log_dir = self.state_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{namespace}.{name}.log"
        for init, init_env in zip(inits, environments, strict=False):
            argv = self._argv(init, self._local_mounts(key, namespace, init, volumes))
            with log_path.open("ab") as out:
                process = await asyncio.create_subprocess_exec(
                    *argv,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    env={**os.environ, **self.env, **init_env},
                    start_new_session=True,
                    preexec_fn=dying_with_this_process(signal.SIGKILL),
                )
                code = await process.wait()
            if code != 0:
                # Like Init:Error then Init:CrashLoopBackOff: the pod does not start; the
                # init container runs again after a pause.
                self._init_backoff[key] = time.monotonic() + INIT_BACKOFF_SECS
                why = f"init container {init.get('name', '?')} exited {code} (see {log_path})"
                await self._pod_waits(key, sandbox, INIT_FAILED, why)
                return
        self._init_backoff.pop(key, None)
        self._waiting.pop(key, None)
        argv = self._argv(container, self._local_mounts(key, namespace, container, volumes))
        env = pod_environment({**os.environ, **self.env}, environments[-1])
        argv, env = self.own_metrics_port(namespace, name, argv, env)
        with log_path.open("ab") as out:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "worker_agent.reaper",
                "--",
                *argv,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=dying_with_this_process(reaper.KILL_TREE),
            )
        grace = float(pod_spec.get("terminationGracePeriodSeconds", 30))
        self.pods[key] = Pod(
            f"{namespace}/{name}", process, grace, claims, manifest=pod_manifest(sandbox, pod_spec)
        )
        log.info("sandbox_pod_started sandbox=%s/%s pid=%d", namespace, name, process.pid)

    async def _pod_waits(self, key: str, sandbox: dict[str, Any], reason: str, why: str) -> None:
        """The pod cannot start for ``why``: logged, and a Warning Event on the Sandbox,
        once per distinct ``why``."""
        if self._waiting.get(key) == why:
            return
        self._waiting[key] = why
        meta = sandbox["metadata"]
        log.warning(
            "sandbox_pod_waiting sandbox=%s/%s reason=%s message=%r",
            meta["namespace"],
            meta["name"],
            reason,
            why,
        )
        event = pod_event(sandbox, reason, why)
        with contextlib.suppress(ApiException):
            await asyncio.to_thread(
                client.CoreV1Api().create_namespaced_event, meta["namespace"], event
            )

    def _local_mounts(
        self, key: str, namespace: str, container: dict[str, Any], volumes: dict[str, Any]
    ) -> dict[str, Path]:
        """Each of the container's mount paths → the local directory standing in for it
        (a PVC's directory, or the Sandbox's own for an emptyDir; then its subPath)."""
        mounts: dict[str, Path] = {}
        for mount_path, (volume, claim, sub_path) in container_mounts(container, volumes).items():
            local = self.volume_dir(namespace, claim) if claim else self.empty_dir(key, volume)
            if sub_path:
                local = local / sub_path
            local.mkdir(parents=True, exist_ok=True)
            mounts[mount_path] = local
        return mounts

    def _argv(self, container: dict[str, Any], mounts: dict[str, Path]) -> list[str]:
        argv = [*container.get("command", []), *container.get("args", [])]
        argv = [self._localize(arg, mounts) for arg in argv]
        if argv and argv[0] == "drainctl":
            argv = [sys.executable, "-m", "orchestrator.cli", *argv[1:]]
        return argv

    def own_metrics_port(
        self, namespace: str, name: str, argv: list[str], env: dict[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        """Give the pod's daemon a free port of its own for its metrics and probes, as a
        pod's own network namespace would (every daemon here shares one machine), and
        write its URL to ``<state>/daemon-metrics/<namespace>.<name>``."""
        port = free_port()
        argv = [f"--metrics-port={port}" if a.startswith("--metrics-port=") else a for a in argv]
        if "--metrics-port" in argv[:-1]:
            argv[argv.index("--metrics-port") + 1] = str(port)
        env = {
            **env,
            "DRAIN_DAEMON_METRICS_PORT": str(port),
            "DRAIN_DAEMON_METRICS_HOST": "127.0.0.1",
        }
        where = self.state_dir / DAEMON_METRICS_DIR
        where.mkdir(parents=True, exist_ok=True)
        (where / f"{namespace}.{name}").write_text(f"http://127.0.0.1:{port}/metrics\n")
        return argv, env

    @staticmethod
    def _localize(arg: str, mounts: dict[str, Path]) -> str:
        for mount_path, local in sorted(mounts.items(), key=lambda m: -len(m[0])):
            if arg == mount_path or arg.startswith(mount_path.rstrip("/") + "/"):
                return str(local) + arg[len(mount_path.rstrip("/")) :]
        return arg

    async def stop_pod(self, key: str) -> None:
        pod = self.pods.get(key)
        if pod is None or pod.stopping:
            return
        pod.stopping = True
        if pod.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                pod.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(pod.process.wait(), pod.grace_secs)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    pod.process.send_signal(reaper.KILL_TREE)
                try:
                    await asyncio.wait_for(pod.process.wait(), KILL_TREE_SECS)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        pod.process.kill()
                    await pod.process.wait()
        log.info("sandbox_pod_stopped sandbox=%s exit=%s", pod.key, pod.process.returncode)
        self.pods.pop(key, None)

    @staticmethod
    def sync_pod_objects(running: list[dict[str, Any]]) -> None:
        """Make the API's stand-in Pod objects those of the running processes: create the
        missing, and let go of those whose process has exited (finalizer removed, object
        deleted), including any left by an earlier run of this controller."""
        api = client.CoreV1Api()
        wanted = {(m["metadata"]["namespace"], m["metadata"]["name"]): m for m in running}
        listed = api.list_pod_for_all_namespaces(label_selector=f"{POD_LABEL}=true")
        shown = {(p.metadata.namespace, p.metadata.name) for p in listed.items}
        for namespace, name in shown - set(wanted):
            with contextlib.suppress(ApiException):
                api.patch_namespaced_pod(
                    name, namespace, {"metadata": {"finalizers": None}}, _content_type=MERGE_PATCH
                )
            with contextlib.suppress(ApiException):
                api.delete_namespaced_pod(name, namespace)
        for (namespace, _), manifest in wanted.items():
            if (namespace, manifest["metadata"]["name"]) in shown:
                continue
            try:
                api.create_namespaced_pod(namespace, manifest)
            except ApiException as exc:
                if exc.status not in (404, 409):  # its namespace is gone, or it is there
                    raise
                continue
            with contextlib.suppress(ApiException):
                api.patch_namespaced_pod_status(
                    manifest["metadata"]["name"],
                    namespace,
                    {"status": {"phase": "Running"}},
                    _content_type=MERGE_PATCH,
                )

    async def collect_volumes(self) -> None:
        root = self.state_dir / csi.VOLUMES_DIR
        if not root.is_dir():
            return
        claims = set(await asyncio.to_thread(csi.list_claims))
        for pod in self.pods.values():  # a volume in use stays, like a PVC protected by a pod
            claims |= pod.claims
        for namespace_dir in root.iterdir():
            for claim_dir in namespace_dir.iterdir():
                if (namespace_dir.name, claim_dir.name) not in claims:
                    log.info("volume_released pvc=%s/%s", namespace_dir.name, claim_dir.name)
                    shutil.rmtree(claim_dir, ignore_errors=True)
