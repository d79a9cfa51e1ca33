"""What the audit reads: the cluster through the Kubernetes API (paged lists, one pass
per kind of object), and workspaces' session files where this process can reach them.

Everything here only reads. The lists are paged (``PAGE``), so a large cluster is read
in bounded requests; a kind the API does not serve (no Sandbox or snapshot CRDs) is an
empty list, not an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from orchestrator.audit.checks import (
    Cluster,
    PodState,
    PvcState,
    SandboxState,
    SessionReading,
    SnapshotState,
    TaskState,
)
from orchestrator.ledger import CheckpointView
from orchestrator.operator import crd
from orchestrator.operator.lifecycle import parse_time
from worker_agent import layout
from worker_agent.session import SessionError, load_session

PAGE: Final = 500
"""Objects per list request."""
API_TIMEOUT_SECS: Final = 30.0


def paged(list_call: Callable[..., Any]) -> Iterator[Any]:
    """Every item of a list call, ``PAGE`` at a time (dicts for custom objects, models
    otherwise)."""
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"limit": PAGE, "_request_timeout": API_TIMEOUT_SECS}
        if token:
            kwargs["_continue"] = token
        page = list_call(**kwargs)
        if isinstance(page, dict):
            yield from page.get("items") or []
            token = (page.get("metadata") or {}).get("continue")
        else:
            yield from page.items or []
            token = page.metadata._continue if page.metadata is not None else None
        if not token:
            return


def _custom(group: str, version: str, plural: str) -> Iterator[dict[str, Any]]:
    api = client.CustomObjectsApi()
    try:
        yield from paged(lambda **kw: api.list_cluster_custom_object(group, version, plural, **kw))
    except ApiException as exc:
        if exc.status != 404:  # not served: there are none
            raise


def _resume_from(spec: Any) -> str | None:
    resume = spec.get("resumeFrom") if isinstance(spec, dict) else None
    ref = resume.get("checkpointRef") if isinstance(resume, dict) else None
    return ref if isinstance(ref, str) and ref else None


def _condition(status: dict[str, Any], type_: str) -> tuple[str, str, str] | None:
    for cond in status.get("conditions") or []:
        if cond.get("type") == type_:
            return (str(cond.get("status")), str(cond.get("reason")), str(cond.get("message")))
    return None


def _arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args[:-1] else None


def read_cluster() -> Cluster:
    """The tasks, Sandboxes, pods, PVCs and VolumeSnapshots of the whole cluster."""
    cluster = Cluster()
    for obj in _custom(crd.GROUP, crd.VERSION, crd.PLURAL):
        meta, status = obj["metadata"], obj.get("status") or {}
        agents = status.get("agents")
        cluster.tasks.append(
            TaskState(
                namespace=str(meta["namespace"]),
                name=str(meta["name"]),
                uid=str(meta["uid"]),
                phase=status.get("phase"),
                phase_since=parse_time(status.get("phaseSince")),
                created_at=parse_time(meta.get("creationTimestamp")),
                agents=int(agents) if isinstance(agents, int) else None,
                checkpoint_ref=status.get("checkpointRef"),
                pvc_name=status.get("pvcName"),
                deleting=bool(meta.get("deletionTimestamp")),
                disruption=status.get("disruption"),
                consistent=_condition(status, "Consistent"),
                sandbox_name=status.get("sandboxName"),
                resume_from=_resume_from(obj.get("spec")),
            )
        )
    stored = sandbox_storage_version()
    cluster.sandboxes_served = stored is not None
    if stored is not None:
        for obj in _custom(crd.SANDBOX_GROUP, stored, crd.SANDBOX_PLURAL):
            cluster.sandboxes.append(_sandbox(f"{crd.SANDBOX_GROUP}/{stored}", obj))
    core = client.CoreV1Api()
    for pod in paged(core.list_pod_for_all_namespaces):
        volumes = (pod.spec.volumes if pod.spec else None) or []
        owners = pod.metadata.owner_references or []
        cluster.pods.append(
            PodState(
                namespace=str(pod.metadata.namespace),
                name=str(pod.metadata.name),
                pvcs=tuple(
                    v.persistent_volume_claim.claim_name
                    for v in volumes
                    if v.persistent_volume_claim
                ),
                controller_uid=next((o.uid for o in owners if o.controller), None),
                terminating=pod.metadata.deletion_timestamp is not None,
            )
        )
    for pvc in paged(core.list_persistent_volume_claim_for_all_namespaces):
        meta = pvc.metadata
        cluster.pvcs.append(
            PvcState(
                namespace=str(meta.namespace),
                name=str(meta.name),
                owner_uids=tuple(o.uid for o in meta.owner_references or [] if o.kind == crd.KIND),
                workspace=crd.TASK_LABEL in (meta.labels or {}),
                terminating=meta.deletion_timestamp is not None,
            )
        )
    try:
        client.ApiextensionsV1Api().read_custom_resource_definition(crd.SNAPSHOT_CRD)
    except ApiException as exc:
        if exc.status != 404:
            raise
        cluster.snapshots_served = False
    for obj in _custom(crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, crd.SNAPSHOT_PLURAL):
        meta = obj["metadata"]
        cluster.snapshots.append(
            SnapshotState(
                namespace=str(meta["namespace"]),
                name=str(meta["name"]),
                uid=str(meta["uid"]),
                checkpoint=(meta.get("labels") or {}).get(crd.CHECKPOINT_LABEL),
                terminating=bool(meta.get("deletionTimestamp")),
            )
        )
    return cluster


def sandbox_storage_version() -> str | None:
    """The version Sandboxes are stored as, at which the audit reads them all: at it
    each shows its suspension whichever version a task or a user wrote it at (with a
    conversion webhook the field is converted into it; without one the other version's
    view would lack the field). None: no Sandbox CRD."""
    try:
        found = client.ApiextensionsV1Api().read_custom_resource_definition(crd.SANDBOX_CRD)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return next((str(v.name) for v in found.spec.versions or [] if v.storage), None)


def _sandbox(api_version: str, obj: dict[str, Any]) -> SandboxState:
    meta, spec = obj["metadata"], obj.get("spec") or {}
    suspended = crd.sandbox_suspended(api_version, obj)
    pod_spec = (spec.get("podTemplate") or {}).get("spec") or {}
    containers = pod_spec.get("containers") or [{}]
    args = [str(a) for a in containers[0].get("args") or []]
    owner = next(
        (o.get("uid") for o in meta.get("ownerReferences") or [] if o.get("kind") == crd.KIND), None
    )
    return SandboxState(
        namespace=str(meta["namespace"]),
        name=str(meta["name"]),
        uid=str(meta["uid"]),
        suspended=suspended,
        owner_uid=owner,
        queue=_arg(args, "--queue"),
        task_uid=_arg(args, "--task-uid"),
    )


# -------------------------------------------------------------------- contents


@dataclass(frozen=True)
class Volumes:
    """Workspaces as directories this process can read: the stand-in Sandbox
    controller's layout (``<root>/volumes/<ns>/<pvc>``, a snapshot's copy in
    ``<root>/snapshots/<snapshot uid>``)."""

    root: Path

    def pvc(self, namespace: str, name: str) -> Path:
        return self.root / "volumes" / namespace / name

    def snapshot(self, uid: str) -> Path:
        return self.root / "snapshots" / uid


def read_sessions(directory: Path, checkpoint: CheckpointView) -> dict[str, SessionReading]:
    """Each agent's session under ``directory`` (a workspace's root), or why it cannot be
    read. A workspace directory that is not there reads as nothing: whether the
    workspace exists is the API's to say."""
    if not directory.is_dir():
        return {}
    readings = {}
    for agent in checkpoint.agents:
        if not layout.session_file(directory / agent.session_dir).exists():
            readings[agent.agent_id] = SessionReading.missing()
            continue
        try:
            session = load_session(directory / agent.session_dir)
        except (OSError, SessionError) as exc:
            readings[agent.agent_id] = SessionReading(None, None, f"is unreadable ({exc})")
        else:
            readings[agent.agent_id] = SessionReading(session.turns, session.sha256)
    return readings
