"""The few Kubernetes calls the operator makes besides kopf's own: Sandboxes, workspace
PVCs, the daemon broker Secret, and CalibanTask status writes. A thin shell over the
official client, run in threads so kopf's event loop never blocks; every function here
is one API call or a small idempotent ensure-step, the names it addresses come from
``crd``, and the decisions about *when* to call it live in ``lifecycle``.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from orchestrator.operator import crd
from orchestrator.operator.lifecycle import SandboxApi, SnapshotClass

_T = TypeVar("_T")

_loaded = False
# The client would otherwise pick the first content type it knows, JSON patch, for any
# body; every call here says which patch it sends.
MERGE_PATCH = "application/merge-patch+json"


def load_credentials() -> None:
    """In-cluster credentials in a pod, else the kubeconfig (``KUBECONFIG``)."""
    global _loaded
    if _loaded:
        return
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    _loaded = True


async def _read(call: Callable[[], _T]) -> _T | None:
    """A read of the Kubernetes API in a thread: None when the object does not exist."""

    def absent_as_none() -> _T | None:
        try:
            return call()
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    return await asyncio.to_thread(absent_as_none)


def _group_version(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.partition("/")
    return group, version


async def create_sandbox(api_version: str, namespace: str, body: dict[str, Any]) -> None:
    group, version = _group_version(api_version)

    def call() -> None:
        try:
            client.CustomObjectsApi().create_namespaced_custom_object(
                group, version, namespace, crd.SANDBOX_PLURAL, body
            )
        except ApiException as exc:
            if exc.status != 409:  # already there: ensure is idempotent
                raise

    await asyncio.to_thread(call)


def broker_secret_body(namespace: str, name: str, url: str) -> dict[str, Any]:
    """The daemon broker Secret: the URL under ``crd.BROKER_SECRET_KEY``, base64 as the API
    stores it. No owner: one Secret serves every task in the namespace."""
    encoded = base64.b64encode(url.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {crd.COMPONENT_LABEL: crd.DAEMON_COMPONENT},
        },
        "data": {crd.BROKER_SECRET_KEY: encoded},
    }


async def ensure_broker_secret(namespace: str, name: str, url: str) -> None:
    """Create Secret ``name`` holding ``url`` in ``namespace``, or patch it when it holds
    another URL (the operator's daemon broker URL changed); untouched when it is right.
    The URL is never logged nor put in an error: it may hold a password."""
    body = broker_secret_body(namespace, name, url)
    api = client.CoreV1Api()

    def call() -> None:
        try:
            existing = api.read_namespaced_secret(name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            try:
                api.create_namespaced_secret(namespace, body)
                return
            except ApiException as exc2:
                if exc2.status != 409:  # created meanwhile (another task): patch it below
                    raise
                existing = api.read_namespaced_secret(name, namespace)
        if (existing.data or {}).get(crd.BROKER_SECRET_KEY) == body["data"][crd.BROKER_SECRET_KEY]:
            return
        api.patch_namespaced_secret(name, namespace, {"data": body["data"]},
                                    _content_type=MERGE_PATCH)  # fmt: skip

    await asyncio.to_thread(call)


async def _create_once(create: Callable[[str, dict[str, Any]], Any], body: dict[str, Any]) -> None:
    """``create(namespace, body)``; an object already there (an earlier pass, or a
    re-created Sandbox) is left as it is."""

    def call() -> None:
        try:
            create(body["metadata"]["namespace"], body)
        except ApiException as exc:
            if exc.status != 409:
                raise

    await asyncio.to_thread(call)


async def ensure_service_account(body: dict[str, Any]) -> None:
    """Create the task's ServiceAccount (``children.service_account``) unless it exists."""
    await _create_once(client.CoreV1Api().create_namespaced_service_account, body)


async def ensure_network_policy(body: dict[str, Any]) -> None:
    """Create the task's NetworkPolicy (``children.network_policy``) unless it exists."""
    await _create_once(client.NetworkingV1Api().create_namespaced_network_policy, body)


async def sandbox_api() -> SandboxApi | None:
    """What the Sandbox CRD serves and stores (None: no such CRD)."""

    found = await _read(
        lambda: client.ApiextensionsV1Api().read_custom_resource_definition(crd.SANDBOX_CRD)
    )
    if found is None:
        return None
    versions = found.spec.versions or []
    conversion = found.spec.conversion
    return SandboxApi(
        served=tuple(str(v.name) for v in versions if v.served),
        storage=next((str(v.name) for v in versions if v.storage), None),
        converts=conversion is not None and conversion.strategy == "Webhook",
    )


async def get_sandbox(api_version: str, namespace: str, name: str) -> dict[str, Any] | None:
    """The Sandbox as the API serves it at ``api_version``, or None if there is none."""
    group, version = _group_version(api_version)
    return await _get_custom(group, version, crd.SANDBOX_PLURAL, namespace, name)


async def patch_sandbox(api_version: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
    group, version = _group_version(api_version)
    await asyncio.to_thread(
        client.CustomObjectsApi().patch_namespaced_custom_object,
        group, version, namespace, crd.SANDBOX_PLURAL, name, patch, _content_type=MERGE_PATCH,
    )  # fmt: skip


async def get_pvc(namespace: str, name: str) -> Any:
    return await _read(
        lambda: client.CoreV1Api().read_namespaced_persistent_volume_claim(name, namespace)
    )


async def ensure_pvc(
    namespace: str,
    name: str,
    storage: str,
    owner: dict[str, Any],
    task_name: str,
    from_snapshot: str | None = None,
    storage_class: str | None = None,
) -> None:
    """Create the workspace PVC owned by the task (filled from VolumeSnapshot
    ``from_snapshot`` when given), or adopt an existing (retained) one."""
    existing = await get_pvc(namespace, name)
    if existing is None:
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {crd.TASK_LABEL: task_name},
                "ownerReferences": [owner],
            },
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": storage}},
            },
        }
        if storage_class is not None:
            body["spec"]["storageClassName"] = storage_class
        if from_snapshot is not None:
            body["spec"]["dataSource"] = {
                "apiGroup": crd.SNAPSHOT_GROUP,
                "kind": crd.SNAPSHOT_KIND,
                "name": from_snapshot,
            }

        def create() -> None:
            try:
                client.CoreV1Api().create_namespaced_persistent_volume_claim(namespace, body)
            except ApiException as exc:
                if exc.status != 409:
                    raise

        await asyncio.to_thread(create)
        return
    owners = existing.metadata.owner_references or []
    if not any(o.uid == owner["uid"] for o in owners):
        patch = {"metadata": {"ownerReferences": [owner], "labels": {crd.TASK_LABEL: task_name}}}
        await asyncio.to_thread(
            client.CoreV1Api().patch_namespaced_persistent_volume_claim,
            name, namespace, patch, _content_type=MERGE_PATCH,
        )  # fmt: skip


async def retain_pvc(namespace: str, name: str, checkpoint_ref: str) -> bool:
    """Drop the task's owner reference (so deleting the task keeps the volume) and label
    the PVC with the checkpoint it holds, in one request. False if there is no such PVC.

    The workspace PVC is owned by its task alone (created or adopted by the operator), so
    the owner list is cleared rather than filtered, which spares a read."""

    def call() -> bool:
        patch = {
            "metadata": {
                "ownerReferences": None,
                "labels": {crd.CHECKPOINT_LABEL: checkpoint_ref},
            }
        }
        try:
            client.CoreV1Api().patch_namespaced_persistent_volume_claim(
                name, namespace, patch, _content_type=MERGE_PATCH
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    return await asyncio.to_thread(call)


async def claim_pvc(
    namespace: str, name: str, resource_version: str, owner: dict[str, Any], task_name: str
) -> bool:
    """Make the task the sole owner of retained PVC ``name``, if the PVC is still at
    ``resource_version`` (what the caller read and judged unheld); False if it changed
    since (another task may have claimed it: read again) or is gone. The version is the
    API server's compare-and-swap, so of two tasks restoring one workspace at once,
    exactly one claims it."""

    def call() -> bool:
        patch = {
            "metadata": {
                "resourceVersion": resource_version,
                "ownerReferences": [owner],
                "labels": {crd.TASK_LABEL: task_name},
            }
        }
        try:
            client.CoreV1Api().patch_namespaced_persistent_volume_claim(
                name, namespace, patch, _content_type=MERGE_PATCH
            )
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    return await asyncio.to_thread(call)


async def pods_mounting(namespace: str, pvc_name: str) -> list[tuple[str, str | None]]:
    """The pods in ``namespace`` that mount PVC ``pvc_name``, running or terminating, as
    (name, uid of the object that controls it: its Sandbox)."""

    def call() -> list[tuple[str, str | None]]:
        listed = client.CoreV1Api().list_namespaced_pod(namespace)
        found = []
        for pod in listed.items:
            volumes = (pod.spec.volumes if pod.spec else None) or []
            if any(v.persistent_volume_claim and v.persistent_volume_claim.claim_name == pvc_name
                   for v in volumes):  # fmt: skip
                owners = pod.metadata.owner_references or []
                controller = next((o.uid for o in owners if o.controller), None)
                found.append((str(pod.metadata.name), controller))
        return found

    return await asyncio.to_thread(call)


async def delete_pvc(namespace: str, name: str) -> bool:
    """Delete PVC ``name``; False if there was none."""
    return await _delete(
        lambda: client.CoreV1Api().delete_namespaced_persistent_volume_claim(name, namespace)
    )


async def _get_custom(
    group: str, version: str, plural: str, namespace: str, name: str
) -> dict[str, Any] | None:
    """A namespaced custom object, or None if there is none."""

    def call() -> dict[str, Any]:
        found: dict[str, Any] = client.CustomObjectsApi().get_namespaced_custom_object(
            group, version, namespace, plural, name
        )
        return found

    return await _read(call)


async def get_workspace(namespace: str, name: str) -> dict[str, Any] | None:
    """caliban-operator's Workspace ``namespace/name``, or None."""
    return await _get_custom(crd.GROUP, crd.VERSION, crd.WORKSPACE_PLURAL, namespace, name)


async def get_task(namespace: str, name: str) -> dict[str, Any] | None:
    """The CalibanTask ``namespace/name``, or None."""
    return await _get_custom(crd.GROUP, crd.VERSION, crd.PLURAL, namespace, name)


async def list_tasks() -> list[dict[str, Any]]:
    """Every CalibanTask in the cluster."""

    def call() -> list[dict[str, Any]]:
        listed = client.CustomObjectsApi().list_cluster_custom_object(
            crd.GROUP, crd.VERSION, crd.PLURAL
        )
        items: list[dict[str, Any]] = listed.get("items", [])
        return items

    return await asyncio.to_thread(call)


# ----------------------------------------------------------------- snapshots


async def _delete(call: Callable[[], object]) -> bool:
    def absent_as_false() -> bool:
        try:
            call()
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    return await asyncio.to_thread(absent_as_false)


async def snapshots_served() -> bool:
    """Whether the cluster serves ``snapshot.storage.k8s.io/v1`` VolumeSnapshots (the
    external-snapshotter's CRDs are installed)."""
    found = await _read(
        lambda: client.ApiextensionsV1Api().read_custom_resource_definition(crd.SNAPSHOT_CRD)
    )
    if found is None:
        return False
    return any(v.name == crd.SNAPSHOT_VERSION and v.served for v in found.spec.versions or [])


async def snapshot_classes() -> list[SnapshotClass]:
    def call() -> list[SnapshotClass]:
        try:
            listed = client.CustomObjectsApi().list_cluster_custom_object(
                crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, crd.SNAPSHOT_CLASS_PLURAL
            )
        except ApiException as exc:
            if exc.status == 404:
                return []
            raise
        return [
            SnapshotClass(
                name=str(item["metadata"]["name"]),
                driver=str(item.get("driver", "")),
                default=(item["metadata"].get("annotations") or {}).get(
                    crd.DEFAULT_SNAPSHOT_CLASS_ANNOTATION
                )
                == "true",
            )
            for item in listed.get("items", [])
        ]

    return await asyncio.to_thread(call)


async def storage_driver(pvc: Any) -> str | None:
    """The CSI driver (provisioner) of the PVC's StorageClass, or of the default class
    when the PVC names none; None when the cluster does not say (no StorageClass API, or
    no such class)."""
    named = pvc.spec.storage_class_name if pvc is not None and pvc.spec else None

    def call() -> str | None:
        api = client.StorageV1Api()
        try:
            if named:
                return str(api.read_storage_class(named).provisioner)
            for item in api.list_storage_class().items:
                annotations = item.metadata.annotations or {}
                if annotations.get(crd.DEFAULT_STORAGE_CLASS_ANNOTATION) == "true":
                    return str(item.provisioner)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return None

    return await asyncio.to_thread(call)


async def create_snapshot(
    namespace: str, name: str, pvc_name: str, class_name: str, labels: dict[str, str]
) -> None:
    """Ask for VolumeSnapshot ``name`` of PVC ``pvc_name`` (idempotent: an existing one
    of that name is kept). It has no owner: a checkpoint outlives its task."""
    body = {
        "apiVersion": crd.SNAPSHOT_API_VERSION,
        "kind": crd.SNAPSHOT_KIND,
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "volumeSnapshotClassName": class_name,
            "source": {"persistentVolumeClaimName": pvc_name},
        },
    }

    def call() -> None:
        try:
            client.CustomObjectsApi().create_namespaced_custom_object(
                crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, namespace, crd.SNAPSHOT_PLURAL, body
            )
        except ApiException as exc:
            if exc.status != 409:
                raise

    await asyncio.to_thread(call)


async def get_snapshot(namespace: str, name: str) -> dict[str, Any] | None:
    return await _get_custom(
        crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, crd.SNAPSHOT_PLURAL, namespace, name
    )


async def list_checkpoint_snapshots(
    namespace: str, refs: Collection[str]
) -> dict[str, dict[str, Any]]:
    """The VolumeSnapshots of checkpoints ``refs`` in ``namespace`` (by their checkpoint
    label), by name, in one call."""
    selector = f"{crd.CHECKPOINT_LABEL} in ({','.join(sorted(refs))})"

    def call() -> dict[str, dict[str, Any]]:
        listed = client.CustomObjectsApi().list_namespaced_custom_object(
            crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, namespace, crd.SNAPSHOT_PLURAL,
            label_selector=selector,
        )  # fmt: skip
        return {str(item["metadata"]["name"]): item for item in listed.get("items") or []}

    return await asyncio.to_thread(call)


async def delete_snapshot(namespace: str, name: str) -> bool:
    """Delete VolumeSnapshot ``name``; False if there was none."""
    return await _delete(
        lambda: client.CustomObjectsApi().delete_namespaced_custom_object(
            crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, namespace, crd.SNAPSHOT_PLURAL, name
        )
    )


async def patch_task_status(
    namespace: str, name: str, status: dict[str, Any]
) -> dict[str, Any] | None:
    """Write a CalibanTask's status now (kopf writes its patch only when a handler ends);
    the object as written, or None when the task is gone."""
    written: dict[str, Any] | None = await _read(
        lambda: client.CustomObjectsApi().patch_namespaced_custom_object_status(
            crd.GROUP,
            crd.VERSION,
            namespace,
            crd.PLURAL,
            name,
            {"status": status},
            _content_type=MERGE_PATCH,
        )
    )
    return written


def drain_guard_name(task_name: str) -> str:
    """The PodDisruptionBudget that guards a task's drain or resume in progress."""
    return f"{task_name[:240]}-drain-guard"


async def guard_against_eviction(
    namespace: str, task_name: str, owner: dict[str, Any], guarded: bool
) -> None:
    """Create (``guarded``) or delete the task's drain guard: a PodDisruptionBudget with
    ``maxUnavailable: 0`` over the task's pod, so a voluntary eviction (``kubectl drain``,
    a cluster autoscaler) waits while a drain or resume is in progress instead of
    interrupting it. Outside an operation there is none: an eviction then is only a
    disruption the daemon's own SIGTERM drain and the operator's recovery absorb, and a
    node drain is never blocked for longer than an operation takes."""
    name = drain_guard_name(task_name)
    api = client.PolicyV1Api()

    def call() -> None:
        try:
            if guarded:
                api.create_namespaced_pod_disruption_budget(namespace, {
                    "apiVersion": "policy/v1",
                    "kind": "PodDisruptionBudget",
                    "metadata": {"name": name, "namespace": namespace,
                                 "labels": {crd.TASK_LABEL: task_name},
                                 "ownerReferences": [owner]},
                    "spec": {"maxUnavailable": 0,
                             "selector": {"matchLabels": {crd.TASK_LABEL: task_name}}},
                })  # fmt: skip
            else:
                api.delete_namespaced_pod_disruption_budget(name, namespace)
        except ApiException as exc:
            if exc.status not in (404, 409):  # already gone, or already there
                raise

    await asyncio.to_thread(call)
