"""The few Kubernetes calls the operator makes besides kopf's own: Sandboxes, workspace
PVCs, and CalibanTask status writes. A thin shell over the official client, run in
threads so kopf's event loop never blocks; every function here is one API call or a
small idempotent ensure-step, the names it addresses come from ``crd``, and the
decisions about *when* to call it live in ``lifecycle``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from orchestrator.operator import crd
from orchestrator.operator.lifecycle import SandboxApi

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

    def call() -> dict[str, Any]:
        found: dict[str, Any] = client.CustomObjectsApi().get_namespaced_custom_object(
            group, version, namespace, crd.SANDBOX_PLURAL, name
        )
        return found

    return await _read(call)


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
    namespace: str, name: str, storage: str, owner: dict[str, Any], task_name: str
) -> None:
    """Create the workspace PVC owned by the task, or adopt an existing (retained) one."""
    existing = await get_pvc(namespace, name)
    if existing is None:
        body = {
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


async def patch_task_status(namespace: str, name: str, status: dict[str, Any]) -> None:
    """Write a CalibanTask's status now (kopf writes its patch only when a handler ends)."""
    await asyncio.to_thread(
        client.CustomObjectsApi().patch_namespaced_custom_object_status,
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, name,
        {"status": status}, _content_type=MERGE_PATCH,
    )  # fmt: skip


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
