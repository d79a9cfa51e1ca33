"""The few Kubernetes calls the operator makes besides kopf's own: Sandboxes, workspace
PVCs, the daemon broker Secret, and CalibanTask and Workspace status writes. A thin shell over
``kubernetes_asyncio``: every call is a coroutine on kopf's event loop, through one
client per loop whose connections are pooled (``API_CONNECTIONS``), so no thread pool
bounds how many are in flight. Every function here is one API call or a small idempotent
ensure-step, the names it addresses come from ``crd``, and the decisions about *when*
to call it live in ``lifecycle``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from kubernetes import client as sync_client
from kubernetes import config as sync_config
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from orchestrator import metrics
from orchestrator.operator import children, crd
from orchestrator.operator.crd import Manifest
from orchestrator.operator.lifecycle import SandboxApi, SnapshotClass
from orchestrator.operator.permissions import refused_as_terminating

_T = TypeVar("_T")
_D = TypeVar("_D")
_A = TypeVar("_A")

_loaded = False
# The client would otherwise pick the first content type it knows, JSON patch, for any
# body; every call here says which patch it sends.
MERGE_PATCH = "application/merge-patch+json"
API_CONNECTIONS: Final = 64
"""The most connections the operator holds open to the API server at once (aiohttp's
limit): a fan-out of passes waits for a free one rather than opening more."""

_own: client.Configuration | None = None
"""In a pod: the credentials ``open_client`` loaded (their token re-read as it rotates)."""
_followed: tuple[object, client.Configuration] | None = None
"""Elsewhere: the synchronous client's default configuration last followed, and the
configuration made from it."""
_clients: dict[tuple[asyncio.AbstractEventLoop, int], client.ApiClient] = {}


def load_credentials() -> None:
    """In-cluster credentials in a pod, else the kubeconfig (``KUBECONFIG``), as the
    synchronous client's default configuration: what the start-up checks
    (``permissions``) use, and what the operator's own calls follow out of a pod."""
    global _loaded
    if _loaded:
        return
    try:
        sync_config.load_incluster_config()
    except sync_config.ConfigException:
        sync_config.load_kube_config()
    _loaded = True


async def open_client() -> None:
    """In a pod, load the service account's credentials for the operator's calls (the
    async client re-reads its token as it rotates); elsewhere they follow the kubeconfig
    ``load_credentials`` loaded."""
    global _own
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        return
    configuration.connection_pool_maxsize = API_CONNECTIONS
    _own = configuration


def _configuration() -> client.Configuration:
    """Where the operator's calls go: ``open_client``'s credentials in a pod; otherwise
    those of the synchronous client's default configuration, as ``load_credentials``,
    ``drainctl``'s ``--kubeconfig`` or a test set it (loaded from the kubeconfig first if
    nothing set it), followed when it is set again."""
    global _followed
    if _own is not None:
        return _own
    if sync_client.Configuration._default is None:
        load_credentials()
    default = sync_client.Configuration._default
    if _followed is None or _followed[0] is not default:
        sync = sync_client.Configuration.get_default_copy()
        api_key, prefix = dict(sync.api_key), dict(sync.api_key_prefix)
        # A client before v36 keeps the token under "authorization"; this one reads it
        # under "BearerToken".
        for keys in (api_key, prefix):
            if "authorization" in keys:
                keys.setdefault("BearerToken", keys.pop("authorization"))
        made = client.Configuration(host=sync.host, api_key=api_key, api_key_prefix=prefix)
        for setting in ("ssl_ca_cert", "cert_file", "key_file", "verify_ssl",
                        "assert_hostname", "tls_server_name", "proxy"):  # fmt: skip
            setattr(made, setting, getattr(sync, setting, None))
        made.connection_pool_maxsize = API_CONNECTIONS
        _followed = (default, made)
    return _followed[1]


def _api(kind: Callable[[client.ApiClient], _A]) -> _A:
    """An API group's calls through this event loop's one client for the current
    configuration (made on first use)."""
    configuration = _configuration()
    key = (asyncio.get_running_loop(), id(configuration))
    found = _clients.get(key)
    if found is None:
        found = _clients[key] = client.ApiClient(configuration)
    return kind(found)


async def close_client() -> None:
    """Close this event loop's clients and their connections (the operator's cleanup, the
    end of a command or a test that made calls)."""
    loop = asyncio.get_running_loop()
    for key in [key for key in _clients if key[0] is loop]:
        await _clients.pop(key).close()


class NamespaceTerminating(Exception):
    """The API refused to create an object in ``namespace`` because the namespace is
    being deleted: nothing new can be made there again, and everything in it is going."""

    def __init__(self, namespace: str) -> None:
        super().__init__(f"namespace {namespace} is being deleted")
        self.namespace = namespace


async def namespace_terminating(namespace: str) -> bool:
    """Whether ``namespace`` is being deleted (or already gone)."""
    found = await _read(lambda: _api(client.CoreV1Api).read_namespace(namespace))
    return found is None or found.metadata.deletion_timestamp is not None


async def _call(
    call: Callable[[], Awaitable[_T]], answers: Mapping[int, _D], namespace: str | None = None
) -> _T | _D:
    """One API call. A refusal whose HTTP status is in ``answers`` is answered with its
    value instead of raised (404: absent, 409: already there, or changed since it was
    read); a create refused because ``namespace`` is being deleted raises
    ``NamespaceTerminating``."""
    try:
        return await _counted(call)
    except ApiException as exc:
        if namespace is not None and refused_as_terminating(exc):
            raise NamespaceTerminating(namespace) from exc
        if exc.status in answers:
            return answers[exc.status]
        raise


async def _counted(call: Callable[[], Awaitable[_T]]) -> _T:
    """Every API call of the operator's own, counted."""
    metrics.OPERATOR_API_CALLS.inc()
    return await call()


async def _read(call: Callable[[], Awaitable[_T]]) -> _T | None:
    """A read: None when the object does not exist."""
    return await _call(call, {404: None})


async def _create(call: Callable[[], Awaitable[object]], namespace: str) -> None:
    """A create that keeps an object already there (an earlier pass made it)."""
    await _call(call, {409: None}, namespace)


async def _done(call: Callable[[], Awaitable[object]], absent: Collection[int] = (404,)) -> bool:
    """A change of an object: False when it is not there (or, with 409 in ``absent``,
    has changed since it was read)."""

    async def changed() -> bool:
        await call()
        return True

    return await _call(changed, dict.fromkeys(absent, False))


def _group_version(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.partition("/")
    return group, version


APPLY_PATCH = "application/apply-patch+yaml"


async def _apply(
    kind: Callable[[client.ApiClient], Any], patch: str, *args: str, body: Manifest
) -> Any:
    """Server-side apply of ``body`` (method ``patch`` of API group ``kind``) by the
    operator's field manager, taking back every field it sets from any other writer
    (``force``): the object is created if it is not there, and made equal to ``body`` in
    what ``body`` says if it is."""
    namespace = body["metadata"]["namespace"]
    return await _call(
        lambda: getattr(_api(kind), patch)(
            *args,
            body,
            field_manager=crd.FIELD_MANAGER,
            force=True,
            _content_type=APPLY_PATCH,
        ),
        {},
        namespace,
    )


async def apply_sandbox(api_version: str, body: Manifest) -> Manifest:
    """The task's Sandbox (``children.sandbox``) applied; the Sandbox as stored."""
    group, version = _group_version(api_version)
    meta = body["metadata"]
    applied: Manifest = await _apply(
        client.CustomObjectsApi, "patch_namespaced_custom_object",
        group, version, meta["namespace"], crd.SANDBOX_PLURAL, meta["name"],
        body=body,
    )  # fmt: skip
    return applied


async def ensure_broker_secret(namespace: str, name: str, url: str) -> None:
    """Create Secret ``name`` holding ``url`` in ``namespace``, or patch it when it holds
    another URL (the operator's daemon broker URL changed); untouched when it is right.
    The URL is never logged nor put in an error: it may hold a password."""
    body = children.broker_secret(namespace, name, url)

    async def call() -> None:
        api = _api(client.CoreV1Api)
        try:
            existing = await api.read_namespaced_secret(name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            try:
                await api.create_namespaced_secret(namespace, body)
                return
            except ApiException as exc2:
                if exc2.status != 409:  # created meanwhile (another task): patch it below
                    raise
                existing = await api.read_namespaced_secret(name, namespace)
        if (existing.data or {}).get(crd.BROKER_SECRET_KEY) == body["data"][crd.BROKER_SECRET_KEY]:
            return
        patch = {"metadata": {"labels": body["metadata"]["labels"]}, "data": body["data"]}
        await api.patch_namespaced_secret(name, namespace, patch, _content_type=MERGE_PATCH)

    await _counted(call)


async def ensure_task_key(body: Manifest) -> None:
    """Create the task's key Secret (``children.task_key_secret``) unless it is there:
    its name carries the task's uid, and its content follows from it."""
    namespace = body["metadata"]["namespace"]
    await _create(
        lambda: _api(client.CoreV1Api).create_namespaced_secret(namespace, body), namespace
    )


async def apply_service_account(body: Manifest) -> None:
    """The task's ServiceAccount (``children.service_account``) applied."""
    meta = body["metadata"]
    await _apply(
        client.CoreV1Api, "patch_namespaced_service_account",
        meta["name"], meta["namespace"], body=body,
    )  # fmt: skip


async def apply_network_policy(body: Manifest) -> None:
    """The task's NetworkPolicy (``children.network_policy``) applied."""
    meta = body["metadata"]
    await _apply(
        client.NetworkingV1Api, "patch_namespaced_network_policy",
        meta["name"], meta["namespace"], body=body,
    )  # fmt: skip


async def sandbox_api() -> SandboxApi | None:
    """What the Sandbox CRD serves and stores (None: no such CRD)."""

    found = await _read(
        lambda: _api(client.ApiextensionsV1Api).read_custom_resource_definition(crd.SANDBOX_CRD)
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


async def get_sandbox(api_version: str, namespace: str, name: str) -> Manifest | None:
    """The Sandbox as the API serves it at ``api_version``, or None if there is none."""
    group, version = _group_version(api_version)
    return await _get_custom(group, version, crd.SANDBOX_PLURAL, namespace, name)


async def patch_sandbox(api_version: str, namespace: str, name: str, patch: Manifest) -> None:
    group, version = _group_version(api_version)
    await _counted(
        lambda: _api(client.CustomObjectsApi).patch_namespaced_custom_object(
            group,
            version,
            namespace,
            crd.SANDBOX_PLURAL,
            name,
            patch,
            _content_type=MERGE_PATCH,
        )
    )


async def patch_sandbox_if_there(
    api_version: str, namespace: str, name: str, patch: Manifest
) -> bool:
    """``patch`` merged into the Sandbox; False when it is not there (deleted by hand)."""
    group, version = _group_version(api_version)
    return await _done(
        lambda: _api(client.CustomObjectsApi).patch_namespaced_custom_object(
            group, version, namespace, crd.SANDBOX_PLURAL, name, patch,
            _content_type=MERGE_PATCH,
        )
    )  # fmt: skip


async def get_pvc(namespace: str, name: str) -> Any:
    return await _read(
        lambda: _api(client.CoreV1Api).read_namespaced_persistent_volume_claim(name, namespace)
    )


async def ensure_pvc(body: Manifest) -> None:
    """Create the workspace PVC ``body`` (``children.workspace_pvc``), or adopt an
    existing (retained) one of its name: owned by the task, labelled with it."""
    meta = body["metadata"]
    namespace, name, owner = meta["namespace"], meta["name"], meta["ownerReferences"][0]
    task_name = meta["labels"][crd.TASK_LABEL]
    existing = await get_pvc(namespace, name)
    if existing is None:
        await _create(
            lambda: _api(client.CoreV1Api).create_namespaced_persistent_volume_claim(
                namespace, body
            ),
            namespace,
        )
        return
    owners = existing.metadata.owner_references or []
    if not any(o.uid == owner["uid"] for o in owners):
        patch = {"metadata": {"ownerReferences": [owner], "labels": children.labels(task_name)}}
        await _counted(
            lambda: _api(client.CoreV1Api).patch_namespaced_persistent_volume_claim(
                name, namespace, patch, _content_type=MERGE_PATCH
            )
        )


async def retain_pvc(namespace: str, name: str, checkpoint_ref: str) -> bool:
    """Drop the task's owner reference (so deleting the task keeps the volume) and label
    the PVC with the checkpoint it holds, in one request. False if there is no such PVC.

    The workspace PVC is owned by its task alone (created or adopted by the operator), so
    the owner list is cleared rather than filtered, which spares a read."""

    patch = {
        "metadata": {"ownerReferences": None, "labels": {crd.CHECKPOINT_LABEL: checkpoint_ref}}
    }
    return await _done(
        lambda: _api(client.CoreV1Api).patch_namespaced_persistent_volume_claim(
            name, namespace, patch, _content_type=MERGE_PATCH
        )
    )


async def claim_pvc(
    namespace: str, name: str, resource_version: str, owner: Manifest, task_name: str
) -> bool:
    """Make the task the sole owner of retained PVC ``name``, if the PVC is still at
    ``resource_version`` (what the caller read and judged unheld); False if it changed
    since (another task may have claimed it: read again) or is gone. The version is the
    API server's compare-and-swap, so of two tasks restoring one workspace at once,
    exactly one claims it."""

    patch = {
        "metadata": {
            "resourceVersion": resource_version,
            "ownerReferences": [owner],
            "labels": children.labels(task_name),
        }
    }
    return await _done(
        lambda: _api(client.CoreV1Api).patch_namespaced_persistent_volume_claim(
            name, namespace, patch, _content_type=MERGE_PATCH
        ),
        absent=(404, 409),
    )


async def pods_mounting(namespace: str, pvc_name: str) -> list[tuple[str, str | None]]:
    """The pods in ``namespace`` that mount PVC ``pvc_name``, running or terminating, as
    (name, uid of the object that controls it: its Sandbox)."""

    async def call() -> list[tuple[str, str | None]]:
        listed = await _api(client.CoreV1Api).list_namespaced_pod(namespace)
        found = []
        for pod in listed.items:
            volumes = (pod.spec.volumes if pod.spec else None) or []
            if any(
                v.persistent_volume_claim and v.persistent_volume_claim.claim_name == pvc_name
                for v in volumes
            ):
                owners = pod.metadata.owner_references or []
                controller = next((o.uid for o in owners if o.controller), None)
                found.append((str(pod.metadata.name), controller))
        return found

    return await _counted(call)


@dataclass(frozen=True)
class TaskPod:
    """A pod of a task's Sandbox, as far as a roll needs it."""

    name: str
    template: str | None
    """Its ``crd.POD_TEMPLATE_ANNOTATION``: the hash of what it was made of (None on a pod
    made before the operator wrote one)."""
    terminating: bool


async def task_pods(namespace: str, task: str) -> list[TaskPod]:
    """The pods carrying task ``task``'s label in ``namespace``."""

    async def call() -> list[TaskPod]:
        listed = await _api(client.CoreV1Api).list_namespaced_pod(
            namespace, label_selector=f"{crd.TASK_LABEL}={task}"
        )
        return [
            TaskPod(
                str(pod.metadata.name),
                (pod.metadata.annotations or {}).get(crd.POD_TEMPLATE_ANNOTATION),
                pod.metadata.deletion_timestamp is not None,
            )
            for pod in listed.items
        ]

    return await _counted(call)


async def daemon_ran_on(namespace: str, pvc_name: str) -> bool:
    """Whether a pod mounting PVC ``pvc_name`` has its daemon's container running, or had
    it running once: phase Running (or ended), or the container's state or last state
    running or terminated. A pod whose init container never finished (a Workspace source
    that cannot be cloned) or whose image never pulled has run nothing."""

    async def call() -> bool:
        for pod in (await _api(client.CoreV1Api).list_namespaced_pod(namespace)).items:
            volumes = (pod.spec.volumes if pod.spec else None) or []
            if not any(
                v.persistent_volume_claim and v.persistent_volume_claim.claim_name == pvc_name
                for v in volumes
            ):
                continue
            status = pod.status
            if status is not None and status.phase in ("Running", "Succeeded", "Failed"):
                return True
            for container in (status.container_statuses if status else None) or []:
                if container.name != crd.DAEMON_CONTAINER:
                    continue
                for state in (container.state, container.last_state):
                    if state is not None and (state.running or state.terminated):
                        return True
        return False

    return await _counted(call)


async def delete_pvc(namespace: str, name: str) -> bool:
    """Delete PVC ``name``; False if there was none."""
    return await _done(
        lambda: _api(client.CoreV1Api).delete_namespaced_persistent_volume_claim(name, namespace)
    )


async def _get_custom(
    group: str, version: str, plural: str, namespace: str, name: str
) -> Manifest | None:
    """A namespaced custom object, or None if there is none."""

    async def call() -> Manifest:
        found: Manifest = await _api(client.CustomObjectsApi).get_namespaced_custom_object(
            group, version, namespace, plural, name
        )
        return found

    return await _read(call)


async def get_workspace(namespace: str, name: str) -> Manifest | None:
    """caliban-operator's Workspace ``namespace/name``, or None."""
    return await _get_custom(crd.GROUP, crd.VERSION, crd.WORKSPACE_PLURAL, namespace, name)


async def get_task(namespace: str, name: str) -> Manifest | None:
    """The CalibanTask ``namespace/name``, or None."""
    return await _get_custom(crd.GROUP, crd.VERSION, crd.PLURAL, namespace, name)


async def list_tasks() -> list[Manifest]:
    """Every CalibanTask in the cluster."""

    async def call() -> list[Manifest]:
        listed = await _api(client.CustomObjectsApi).list_cluster_custom_object(
            crd.GROUP, crd.VERSION, crd.PLURAL
        )
        items: list[Manifest] = listed.get("items", [])
        return items

    return await _counted(call)


# ----------------------------------------------------------------- snapshots


async def snapshots_served() -> bool:
    """Whether the cluster serves ``snapshot.storage.k8s.io/v1`` VolumeSnapshots (the
    external-snapshotter's CRDs are installed)."""
    found = await _read(
        lambda: _api(client.ApiextensionsV1Api).read_custom_resource_definition(crd.SNAPSHOT_CRD)
    )
    if found is None:
        return False
    return any(v.name == crd.SNAPSHOT_VERSION and v.served for v in found.spec.versions or [])


async def snapshot_classes() -> list[SnapshotClass]:
    listed = await _read(
        lambda: _api(client.CustomObjectsApi).list_cluster_custom_object(
            crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, crd.SNAPSHOT_CLASS_PLURAL
        )
    )
    return [
        SnapshotClass(
            name=str(item["metadata"]["name"]),
            driver=str(item.get("driver", "")),
            default=(item["metadata"].get("annotations") or {}).get(
                crd.DEFAULT_SNAPSHOT_CLASS_ANNOTATION
            )
            == "true",
        )
        for item in (listed or {}).get("items", [])
    ]


async def storage_driver(pvc: Any) -> str | None:
    """The CSI driver (provisioner) of the PVC's StorageClass, or of the default class
    when the PVC names none; None when the cluster does not say (no StorageClass API, or
    no such class)."""
    named = pvc.spec.storage_class_name if pvc is not None and pvc.spec else None

    async def call() -> str | None:
        api = _api(client.StorageV1Api)
        if named:
            return str((await api.read_storage_class(named)).provisioner)
        for item in (await api.list_storage_class()).items:
            annotations = item.metadata.annotations or {}
            if annotations.get(crd.DEFAULT_STORAGE_CLASS_ANNOTATION) == "true":
                return str(item.provisioner)
        return None

    return await _read(call)


async def create_snapshot(body: Manifest) -> None:
    """Ask for VolumeSnapshot ``body`` (``children.workspace_snapshot``), idempotently: an
    existing one of its name is kept."""
    namespace = body["metadata"]["namespace"]
    await _create(
        lambda: _api(client.CustomObjectsApi).create_namespaced_custom_object(
            crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, namespace, crd.SNAPSHOT_PLURAL, body
        ),
        namespace,
    )


async def get_snapshot(namespace: str, name: str) -> Manifest | None:
    return await _get_custom(
        crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, crd.SNAPSHOT_PLURAL, namespace, name
    )


async def list_checkpoint_snapshots(namespace: str, refs: Collection[str]) -> dict[str, Manifest]:
    """The VolumeSnapshots of checkpoints ``refs`` in ``namespace`` (by their checkpoint
    label), by name, in one call (none in a namespace that is gone)."""
    selector = f"{crd.CHECKPOINT_LABEL} in ({','.join(sorted(refs))})"

    async def call() -> dict[str, Manifest]:
        listed = await _api(client.CustomObjectsApi).list_namespaced_custom_object(
            crd.SNAPSHOT_GROUP,
            crd.SNAPSHOT_VERSION,
            namespace,
            crd.SNAPSHOT_PLURAL,
            label_selector=selector,
        )
        return {str(item["metadata"]["name"]): item for item in listed.get("items") or []}

    found: dict[str, Manifest] = await _call(call, {404: {}})
    return found


async def delete_snapshot(namespace: str, name: str) -> bool:
    """Delete VolumeSnapshot ``name``; False if there was none."""
    return await _done(
        lambda: _api(client.CustomObjectsApi).delete_namespaced_custom_object(
            crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, namespace, crd.SNAPSHOT_PLURAL, name
        )
    )


EVENT_COMPONENT = "kopf"
"""The component the operator's events are reported by: kopf's, which posts the rest."""


async def post_event(involved: Manifest, type_: str, reason: str, message: str) -> bool:
    """A core v1 Event about object ``involved`` (as the API served it), as kopf posts
    the operator's others, for a caller outside kopf's handlers; False if the API
    refused it (events are auxiliary: never an error of the caller's)."""
    meta = involved["metadata"]
    now = datetime.now(UTC).isoformat()
    body = {
        "metadata": {"namespace": meta["namespace"], "generateName": "kopf-event-"},
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "reportingComponent": EVENT_COMPONENT,
        "source": {"component": EVENT_COMPONENT},
        "involvedObject": {
            "apiVersion": involved.get("apiVersion"),
            "kind": involved.get("kind"),
            "namespace": meta["namespace"],
            "name": meta["name"],
            "uid": meta.get("uid"),
        },
        "firstTimestamp": now,
        "lastTimestamp": now,
        "eventTime": now,
    }
    try:
        await _counted(
            lambda: _api(client.CoreV1Api).create_namespaced_event(meta["namespace"], body)
        )
    except ApiException:
        return False
    return True


async def _patch_status(
    plural: str, namespace: str, name: str, status: Manifest
) -> Manifest | None:
    """Merge ``status`` into the status subresource of our group's ``plural`` ``name``;
    the object as written, or None when it is gone."""
    written: Manifest | None = await _read(
        lambda: _api(client.CustomObjectsApi).patch_namespaced_custom_object_status(
            crd.GROUP,
            crd.VERSION,
            namespace,
            plural,
            name,
            {"status": status},
            _content_type=MERGE_PATCH,
        )
    )
    return written


async def annotate_task(namespace: str, name: str, annotations: dict[str, str]) -> None:
    """Set annotations on CalibanTask ``namespace/name`` (nothing if it is gone)."""
    await _read(
        lambda: _api(client.CustomObjectsApi).patch_namespaced_custom_object(
            crd.GROUP,
            crd.VERSION,
            namespace,
            crd.PLURAL,
            name,
            {"metadata": {"annotations": annotations}},
            _content_type=MERGE_PATCH,
        )
    )


async def patch_task_status(namespace: str, name: str, status: Manifest) -> Manifest | None:
    """Write a CalibanTask's status now (kopf writes its patch only when a handler ends);
    the object as written, or None when the task is gone."""
    return await _patch_status(crd.PLURAL, namespace, name, status)


async def patch_workspace_status(namespace: str, name: str, status: Manifest) -> Manifest | None:
    """Merge ``status`` into Workspace ``namespace/name``'s status (``workspace_status``);
    the Workspace as written, or None when it is gone."""
    return await _patch_status(crd.WORKSPACE_PLURAL, namespace, name, status)


async def guard_against_eviction(
    namespace: str, task_name: str, owner: Manifest, guarded: bool
) -> None:
    """Create (``guarded``) or delete the task's drain guard: a PodDisruptionBudget with
    ``maxUnavailable: 0`` over the task's pod, so a voluntary eviction (``kubectl drain``,
    a cluster autoscaler) waits while a drain or resume is in progress instead of
    interrupting it. Outside an operation there is none: an eviction then is only a
    disruption the daemon's own SIGTERM drain and the operator's recovery absorb, and a
    node drain is never blocked for longer than an operation takes."""
    name = children.drain_guard_name(task_name)
    if not guarded:
        await _done(
            lambda: _api(client.PolicyV1Api).delete_namespaced_pod_disruption_budget(
                name, namespace
            )
        )
        return
    guard = children.drain_guard(task_name, namespace, owner)
    await _create(
        lambda: _api(client.PolicyV1Api).create_namespaced_pod_disruption_budget(namespace, guard),
        namespace,
    )
