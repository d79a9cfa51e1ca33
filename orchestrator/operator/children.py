"""The objects the operator writes, as it writes them: a task's Sandbox (``<task>-sbx``)
with its pod template, its workspace PVC, and, as caliban-operator makes them, its
ServiceAccount (``<task>-sa``) and NetworkPolicy (``<task>-netpol``); its drain guard
(``<task>-drain-guard``, a PodDisruptionBudget while an operation runs), the namespace's
daemon broker Secret, and each checkpoint's VolumeSnapshot. Pure builders of (task,
spec, settings) → object, so every shape is table-tested apart from the API calls that
create them (``kube``). A task's children are owned by it (``TaskRef.owner``); the
broker Secret (shared by the namespace's tasks) and the snapshots (a checkpoint outlives
its task) are not.

Every one carries ``app.kubernetes.io/managed-by: caliban-drain`` (``crd.MANAGED_BY``)
and, but for the broker Secret, the task label. The Sandbox's pod template does not
carry the managed-by label: the pod is made and managed by the Sandbox's controller,
and is found by the task label.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from orchestrator.operator import crd
from orchestrator.operator import workspace as workspaces
from orchestrator.operator.crd import Manifest
from orchestrator.operator.lifecycle import TaskSpec, sandbox_suspension_patch
from orchestrator.settings import Settings
from worker_agent import signing
from worker_agent.contract import daemon_queue
from worker_agent.logformat import LOG_FORMAT_ENV, LogSettings

DAEMON_METRICS_HOST_ENV: Final = "DRAIN_DAEMON_METRICS_HOST"
POD_IP: Final[Manifest] = {"fieldRef": {"fieldPath": "status.podIP"}}
SA_SUFFIX = "-sa"
NETPOL_SUFFIX = "-netpol"
DNS_PORT = 53
_DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "amqp": 5672, "amqps": 5671}


def labels(task: str) -> dict[str, str]:
    """The labels of every child of task ``task``: whose it is, and who manages it."""
    return {crd.TASK_LABEL: task, crd.MANAGED_BY_LABEL: crd.MANAGED_BY}


@dataclass(frozen=True)
class TaskRef:
    """The CalibanTask a child belongs to."""

    namespace: str
    name: str
    uid: str

    def owner(self) -> Manifest:
        """The owner reference every child carries: it goes with the task (garbage
        collection), and the task is its controller."""
        return {
            "apiVersion": crd.API_VERSION,
            "kind": crd.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True)
class PodSettings:
    """What the operator's configuration puts into every task's pod."""

    daemon_image: str
    """The image when the spec names none (``DRAIN_DAEMON_IMAGE``)."""
    broker_secret: str
    """The namespace's Secret the daemon reads the broker URL from."""
    log_format: str
    """The operator's own log format, so one ``DRAIN_LOG_FORMAT`` sets all."""
    signs: bool = False
    """Whether daemons sign what they send (``DRAIN_MESSAGE_KEY`` set): the pod then
    reads its task's key from the task's key Secret (``task_key_secret``)."""

    @classmethod
    def of(cls, settings: Settings) -> PodSettings:
        """From the operator's settings, with the log format it logs in itself."""
        return cls(
            settings.daemon_image,
            settings.daemon_broker_secret,
            LogSettings().log_format,
            signs=settings.message_key is not None,
        )


def sandbox(task: TaskRef, spec: TaskSpec, pvc_name: str, pod: PodSettings) -> Manifest:
    """The task's Sandbox: one pod running ``drainctl daemon`` on workspace PVC
    ``pvc_name`` with the spec's agents, as the restricted, token-less pod the operator
    shapes (``crd.POD_SECURITY_CONTEXT``), the spec's ``sandbox.podTemplate`` merged
    under it (``merge_under``), and the Workspace's provider and sources where the spec
    is bound to one."""
    args = [
        "daemon", "--store", crd.WORKSPACE_MOUNT,
        "--socket", f"{crd.RUN_MOUNT}/{crd.DAEMON_SOCKET_FILE}",
        "--queue", daemon_queue(task.namespace, task.name), "--task-uid", task.uid,
        "--drain-grace", str(spec.drain_grace_secs),
        "--initial-agents", str(spec.agents), "--initial-provider", spec.provider,
    ]  # fmt: skip
    if spec.model:
        args += ["--initial-model", spec.model]
    if spec.prompt:
        args += ["--initial-prompt", spec.prompt]
    args += ["--metrics-port", str(crd.DAEMON_METRICS_PORT)]
    # The URL may hold a password: the pod reads it from the namespace's Secret
    # (``kube.ensure_broker_secret``), so it is never in the Sandbox spec.
    broker = {"secretKeyRef": {"name": pod.broker_secret, "key": crd.BROKER_SECRET_KEY}}
    pod_spec: Manifest = {
        "serviceAccountName": service_account_name(task.name),
        "automountServiceAccountToken": False,
        "securityContext": copy.deepcopy(crd.POD_SECURITY_CONTEXT),
        "terminationGracePeriodSeconds": int(spec.drain_grace_secs) + 30,
        "containers": [
            {
                "name": crd.DAEMON_CONTAINER,
                "image": spec.image or pod.daemon_image,
                "command": ["drainctl"],
                "args": args,
                "env": [
                    {"name": crd.BROKER_URL_ENV, "valueFrom": broker},
                    # Metrics and probes on the pod's own address, where the kubelet
                    # and the scrape reach them, and nowhere else.
                    {"name": DAEMON_METRICS_HOST_ENV, "valueFrom": POD_IP},
                    {"name": LOG_FORMAT_ENV, "value": pod.log_format},
                    *_task_key_env(task, pod),
                    *({"name": n, "value": v} for n, v in spec.upstream_env),
                    *({"name": n, "value": v} for n, v in spec.env),
                ],
                "ports": [{"name": "metrics", "containerPort": crd.DAEMON_METRICS_PORT}],
                "livenessProbe": dict(crd.DAEMON_LIVENESS_PROBE),
                "readinessProbe": dict(crd.DAEMON_READINESS_PROBE),
                "securityContext": copy.deepcopy(crd.CONTAINER_SECURITY_CONTEXT),
                "volumeMounts": [
                    {"name": "workspace", "mountPath": crd.WORKSPACE_MOUNT},
                    {"name": crd.RUN_VOLUME, "mountPath": crd.RUN_MOUNT},
                    {"name": crd.TMP_VOLUME, "mountPath": crd.TMP_MOUNT},
                ],
            }
        ],
        "volumes": [
            {"name": "workspace", "persistentVolumeClaim": {"claimName": pvc_name}},
            {"name": crd.RUN_VOLUME, "emptyDir": {}},
            {"name": crd.TMP_VOLUME, "emptyDir": {}},
        ],
    }
    # The sandboxed runtime the task asks for, else its Workspace's default.
    runtime_class = spec.runtime_class or (spec.binding.runtime_class if spec.binding else None)
    if runtime_class:
        pod_spec["runtimeClassName"] = runtime_class
    if spec.binding is not None:
        # The Workspace's provider (its key through secretKeyRef), its sources'
        # mounts, and the init container that clones them once.
        parts = workspaces.pod_parts(spec.binding, pod_spec["containers"][0]["image"])
        pod_spec["containers"][0]["env"] += parts["env"]
        pod_spec["containers"][0]["volumeMounts"] += parts["volumeMounts"]
        pod_spec["initContainers"] = parts["initContainers"]
    suspended = sandbox_suspension_patch(spec.sandbox_version, False)["spec"]
    pod_labels = {crd.TASK_LABEL: task.name, crd.COMPONENT_LABEL: crd.DAEMON_COMPONENT}
    return {
        "apiVersion": spec.sandbox_version,
        "kind": crd.SANDBOX_KIND,
        "metadata": {
            "name": crd.sandbox_name(task.name),
            "namespace": task.namespace,
            "ownerReferences": [task.owner()],
            "labels": labels(task.name),
        },
        "spec": {
            **suspended,
            # The task label is how the drain guard (a PodDisruptionBudget) finds the
            # pod; the component label is what the daemon NetworkPolicy selects.
            # The user's spec.sandbox.podTemplate goes under ours: what it adds is
            # kept, what it sets that we set is ours.
            "podTemplate": with_template_hash(
                merge_under(
                    {"metadata": {"labels": pod_labels}, "spec": pod_spec}, spec.pod_template
                )
            ),
        },
    }


def pod_template_hash(template: Manifest) -> str:
    """What a pod made from ``template`` is made of, as a short hash: everything but
    what the daemon takes without a new pod (its arguments: the agents, provider, model
    and prompt a fresh start spawns, the drain grace, which every drain request carries)
    and the termination grace that follows the drain grace. A pod whose hash differs
    from its spec's (a new image, env, podTemplate, resources or runtimeClass) is rolled:
    drained, checkpointed and made again (``rolling``)."""
    shape = copy.deepcopy(template)
    meta = shape.get("metadata") or {}
    annotations = meta.pop("annotations", None) or {}
    annotations.pop(crd.POD_TEMPLATE_ANNOTATION, None)
    if annotations:
        meta["annotations"] = annotations
    pod_spec = shape.get("spec") or {}
    pod_spec.pop("terminationGracePeriodSeconds", None)
    for container in pod_spec.get("containers") or []:
        if container.get("name") == crd.DAEMON_CONTAINER:
            container.pop("args", None)
    canonical = json.dumps(shape, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def with_template_hash(template: Manifest) -> Manifest:
    """``template`` annotated with its ``pod_template_hash``, which its pod carries."""
    meta = template.setdefault("metadata", {})
    annotations = dict(meta.get("annotations") or {})
    annotations[crd.POD_TEMPLATE_ANNOTATION] = pod_template_hash(template)
    meta["annotations"] = annotations
    return template


def workspace_pvc(
    task: TaskRef,
    name: str,
    storage: str,
    *,
    from_snapshot: str | None = None,
    storage_class: str | None = None,
) -> Manifest:
    """The task's workspace PVC, owned by the task (a deletion's checkpoint drops that
    reference to keep it), filled from VolumeSnapshot ``from_snapshot`` when given."""
    body: Manifest = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": name,
            "namespace": task.namespace,
            "labels": labels(task.name),
            "ownerReferences": [task.owner()],
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
    return body


def service_account_name(task: str) -> str:
    return f"{task}{SA_SUFFIX}"


def network_policy_name(task: str) -> str:
    return f"{task}{NETPOL_SUFFIX}"


def broker_port(url: str) -> int:
    """The TCP port a broker URL connects to: its explicit port, else its scheme's
    default. A scheme without one is refused, since a policy must name the port."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"broker URL has an invalid port: {exc}") from None
    if port is not None:
        return port
    if parts.scheme not in _DEFAULT_PORTS:
        raise ValueError(f"broker URL scheme {parts.scheme!r} has no known default port")
    return _DEFAULT_PORTS[parts.scheme]


def service_account(task: str, namespace: str, owner: Manifest) -> Manifest:
    """The pod's identity: no token mounted, bound to no Role (the daemon calls no API)."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {
            "name": service_account_name(task),
            "namespace": namespace,
            "ownerReferences": [owner],
            "labels": labels(task),
        },
        "automountServiceAccountToken": False,
    }


DNS_PEER: Final[Manifest] = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
}
"""The cluster's DNS: kube-dns's pods in kube-system (CoreDNS keeps that label)."""


@dataclass(frozen=True)
class NetworkPeers:
    """Who a task's pod may be reached by and reach, by label (``Settings``)."""

    monitoring_namespaces: dict[str, str] = field(
        default_factory=lambda: {crd.MONITORING_NAMESPACE_LABEL: "true"}
    )
    broker_namespaces: dict[str, str] = field(
        default_factory=lambda: {crd.BROKER_NAMESPACE_LABEL: "true"}
    )
    broker_pods: dict[str, str] = field(default_factory=lambda: {crd.BROKER_POD_LABEL: "true"})

    @classmethod
    def of(cls, settings: Settings) -> NetworkPeers:
        return cls(
            dict(settings.monitoring_namespace_selector),
            dict(settings.broker_namespace_selector),
            dict(settings.broker_pod_selector),
        )

    def broker(self) -> list[Manifest]:
        """The broker's pods as a rule's ``to``; empty (anywhere) when no selector is set."""
        peer: Manifest = {}
        if self.broker_namespaces:
            peer["namespaceSelector"] = {"matchLabels": dict(self.broker_namespaces)}
        if self.broker_pods:
            peer["podSelector"] = {"matchLabels": dict(self.broker_pods)}
        return [peer] if peer else []


def network_policy(
    task: str,
    namespace: str,
    owner: Manifest,
    broker_url: str,
    workspace_ports: Sequence[int] = (),
    peers: NetworkPeers | None = None,
) -> Manifest:
    """The task's pod takes connections only on the daemon's metrics port and only from
    the monitoring namespaces (the scrape; the kubelet's probes are not subject to a
    NetworkPolicy), as deploy/task-namespace/daemon-networkpolicy.yaml allows; it reaches
    only the cluster's DNS, the broker's pods on the broker's port and ``workspace_ports``
    (its Workspace provider's and git remotes', ``workspace.egress_ports``, wherever
    they are: those hosts are outside the cluster)."""
    peers = peers or NetworkPeers()
    dns_ports = [{"protocol": "UDP", "port": DNS_PORT}, {"protocol": "TCP", "port": DNS_PORT}]
    to_broker: Manifest = {"ports": [{"protocol": "TCP", "port": broker_port(broker_url)}]}
    if peers.broker():
        to_broker = {"to": peers.broker(), **to_broker}
    egress: list[Manifest] = [{"to": [copy.deepcopy(DNS_PEER)], "ports": dns_ports}, to_broker]
    if workspace_ports:
        egress.append({"ports": [{"protocol": "TCP", "port": p} for p in workspace_ports]})
    scrape: Manifest = {"ports": [{"protocol": "TCP", "port": crd.DAEMON_METRICS_PORT}]}
    if peers.monitoring_namespaces:
        scrape = {
            "from": [{"namespaceSelector": {"matchLabels": dict(peers.monitoring_namespaces)}}],
            **scrape,
        }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": network_policy_name(task),
            "namespace": namespace,
            "ownerReferences": [owner],
            "labels": labels(task),
        },
        "spec": {
            "podSelector": {"matchLabels": {crd.TASK_LABEL: task}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [scrape],
            "egress": egress,
        },
    }


def drain_guard_name(task_name: str) -> str:
    """The PodDisruptionBudget that guards a task's drain or resume in progress."""
    return f"{task_name[:240]}-drain-guard"


def drain_guard(task: str, namespace: str, owner: Manifest) -> Manifest:
    """The drain guard: ``maxUnavailable: 0`` over the task's pod (its task label), so a
    voluntary eviction waits while a drain or resume runs (``kube.guard_against_eviction``)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": drain_guard_name(task), "namespace": namespace,
                     "labels": labels(task), "ownerReferences": [owner]},
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {crd.TASK_LABEL: task}}},
    }  # fmt: skip


def broker_secret(namespace: str, name: str, url: str) -> Manifest:
    """The daemon broker Secret: the URL under ``crd.BROKER_SECRET_KEY``, base64 as the API
    stores it. No owner and no task label: one Secret serves every task in the namespace
    (``kube.ensure_broker_secret``)."""
    encoded = base64.b64encode(url.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                crd.COMPONENT_LABEL: crd.DAEMON_COMPONENT, crd.MANAGED_BY_LABEL: crd.MANAGED_BY,
            },
        },
        "data": {crd.BROKER_SECRET_KEY: encoded},
    }  # fmt: skip


def _task_key_env(task: TaskRef, pod: PodSettings) -> list[Manifest]:
    """The daemon's ``DRAIN_TASK_KEY`` from the task's key Secret, where daemons sign."""
    if not pod.signs:
        return []
    ref = {"name": task_key_secret_name(task), "key": crd.TASK_KEY_SECRET_KEY}
    return [{"name": signing.TASK_KEY_ENV, "valueFrom": {"secretKeyRef": ref}}]


def task_key_secret_name(task: TaskRef) -> str:
    """The Secret holding the key of task ``task`` (one per uid: a task re-created
    under the name of one still being collected gets its own)."""
    return f"{task.name}-key-{task.uid}"


def task_key_secret(task: TaskRef, message_key: bytes) -> Manifest:
    """The task's key (``signing.task_key``, hex) under ``crd.TASK_KEY_SECRET_KEY``, owned
    by the task; only its pod reads it, through a ``secretKeyRef``."""
    key = signing.task_key(message_key, task.namespace, task.name, task.uid).hex()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": task_key_secret_name(task),
            "namespace": task.namespace,
            "ownerReferences": [task.owner()],
            "labels": labels(task.name),
        },
        "data": {crd.TASK_KEY_SECRET_KEY: base64.b64encode(key.encode()).decode()},
    }


def workspace_snapshot(task: TaskRef, ref: str, pvc_name: str, class_name: str) -> Manifest:
    """Checkpoint ``ref``'s VolumeSnapshot of the task's workspace PVC ``pvc_name``, named
    by the ref (one per checkpoint). No owner: a checkpoint outlives its task. Labelled
    with the checkpoint (what deletions waiting for it list it by), the task and its uid."""
    return {
        "apiVersion": crd.SNAPSHOT_API_VERSION,
        "kind": crd.SNAPSHOT_KIND,
        "metadata": {
            "name": ref,
            "namespace": task.namespace,
            "labels": {
                **labels(task.name), crd.CHECKPOINT_LABEL: ref, crd.TASK_UID_LABEL: task.uid,
            },
        },
        "spec": {
            "volumeSnapshotClassName": class_name,
            "source": {"persistentVolumeClaimName": pvc_name},
        },
    }  # fmt: skip


NAMED_LISTS: frozenset[str] = frozenset({
    "containers", "initContainers", "ephemeralContainers", "volumes", "env", "envFrom",
    "volumeMounts", "volumeDevices", "ports", "imagePullSecrets", "resourceClaims",
})  # fmt: skip
"""The pod-spec lists whose items are keyed by ``name`` (a strategic merge's keys)."""


def merge_under(ours: Manifest, theirs: Manifest) -> Manifest:
    """``theirs`` (``spec.sandbox.podTemplate``) merged under ``ours`` (the pod template
    the operator generates): what the user adds is kept (a nodeSelector, tolerations, a
    label, a sidecar, the daemon container's resources); where both set a value, ours
    wins, so the user cannot unset what the drain contract needs (the task label, the
    token-less ServiceAccount, the daemon's args, its workspace mount). Objects merge key
    by key; the lists of ``NAMED_LISTS`` merge item by item on ``name``, ours first; any
    other list is ours where we set one."""
    merged = dict(theirs)
    for key, value in ours.items():
        under = theirs.get(key)
        if isinstance(value, dict) and isinstance(under, dict):
            merged[key] = merge_under(value, under)
        elif key in NAMED_LISTS and isinstance(value, list) and isinstance(under, list):
            merged[key] = _merge_named(value, under)
        else:
            merged[key] = value
    return merged


def _merge_named(ours: list[Any], theirs: list[Any]) -> list[Any]:
    def name(item: Any) -> Any:
        return item.get("name") if isinstance(item, dict) else None

    by_name = {name(item): item for item in theirs if name(item) is not None}
    taken = {name(item) for item in ours} - {None}
    merged = [
        merge_under(item, by_name[name(item)]) if name(item) in by_name else item for item in ours
    ]
    return merged + [item for item in theirs if name(item) is None or name(item) not in taken]
