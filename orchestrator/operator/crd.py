"""The names on the wire: the one place the CalibanTask's and the Sandbox's API names live.

Group, version, plural and kind of the CalibanTask (``deploy/crds/calibantask.yaml``
declares the same, and a unit test holds the two together), the drain finalizer, the
labels and annotations the operator reads and writes, the prefix of kopf's own
bookkeeping annotations, and the Sandbox API versions and plural. The operator's
handlers, its Kubernetes calls, the pure lifecycle, the CLI, the stand-in Sandbox
controller and the benchmarks import these instead of spelling them.

Constants, and the two rules that read them (``sandbox_name``, ``sandbox_suspended``);
this module imports nothing but the standard library, so any side (the CLI, the embedded API, a
benchmark) can import it without pulling in kopf or the Kubernetes client. Every value
is part of the API that users, other controllers and stored objects rely on: changing
one is a migration, not a refactor.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, Final, TypeAlias

from worker_agent.k8s_names import is_dns1035_label

Manifest: TypeAlias = dict[str, Any]
"""A Kubernetes object, or a part of one, as JSON: as the API serves it and as the
builders write it (``children``). Its schema is the API's; the operator reads the few
fields it needs by name."""

# ------------------------------------------------------------------ the CalibanTask

GROUP: Final = "caliban.caliban-ai.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
PLURAL: Final = "calibantasks"
KIND: Final = "CalibanTask"

FINALIZER: Final = f"{GROUP}/drain"
"""The drain finalizer: a deleted task stays until its agents are checkpointed."""

PHASE_ANNOTATION: Final = f"{GROUP}/phase"
"""Where the operator keeps the phase it decided for a task: a status writer cannot
change metadata, so another controller writing ``status.phase`` (caliban-operator writes
its own) never changes what this operator decides; it corrects the status instead."""
WAKE_ANNOTATION: Final = f"{GROUP}/wake"
"""A new value resumes an idle-paused task once (what an attach does)."""

TASK_LABEL: Final = f"{GROUP}/task"
"""On a task's Sandbox and workspace PVC: the task's name."""

CHECKPOINT_LABEL: Final = f"{GROUP}/checkpoint"
MONITORING_NAMESPACE_LABEL: Final = f"{GROUP}/monitoring"
"""On the namespaces whose pods may scrape a task pod's metrics (the default selector)."""
BROKER_NAMESPACE_LABEL: Final = f"{GROUP}/broker-namespace"
BROKER_POD_LABEL: Final = f"{GROUP}/broker"
"""On the broker's namespace and pods: the only destination of a task pod's broker port."""
"""On a retained workspace PVC: the ref of the checkpoint it holds."""

MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "caliban-drain"
"""``MANAGED_BY_LABEL``'s value (Kubernetes' recommended label for the tool that manages
an object) on every object the operator creates: a task's Sandbox, workspace PVC,
ServiceAccount, NetworkPolicy and drain guard, the namespace's broker Secret, and each
checkpoint's VolumeSnapshot (``children``'s builders). Not on the Sandbox's pod
template: the pod is the Sandbox controller's to make and manage, and carries the task
label (``TASK_LABEL``) that selects it."""

TASK_KEY_SECRET_KEY: Final = "key"  # noqa: S105 - a key of a Secret's data
"""The key of a task's key Secret (``children.task_key_secret``) holding its key."""

FIELD_MANAGER: Final = "caliban-drain"
"""The field manager of the operator's server-side applies: the fields of a task's
Sandbox, ServiceAccount and NetworkPolicy it sets are owned by it (``metadata.
managedFields``), and each pass takes them back from any other writer (``force``)."""

POD_TEMPLATE_ANNOTATION: Final = f"{GROUP}/pod-template"
"""On the Sandbox's pod template, so on its pod: the hash of what the pod is made of
(``children.pod_template_hash``). A live pod whose hash is not the spec's is rolled."""

KOPF_ANNOTATION_PREFIX: Final = GROUP
"""kopf keeps its handler progress and last-handled state in annotations under this prefix
(``<prefix>/<handler id>``), so they sit beside ours rather than under ``kopf.zalando.org``.
Renaming it orphans the progress of objects already stored."""

KOPF_DIFFBASE_KEY: Final = "last-handled-configuration"

# ------------------------------------------------------------------- the Workspace

WORKSPACE_PLURAL: Final = "workspaces"
WORKSPACE_KIND: Final = "Workspace"
"""caliban-operator's Workspace (same group and version as the CalibanTask): git sources
and model providers a task's ``spec.workspaceRef`` names."""

SOURCES_DIR: Final = "sources"
"""On the workspace PVC: where the Workspace's sources are cloned, one directory each."""

# ----------------------------------------------------------------------- the Sandbox

SANDBOX_GROUP: Final = "agents.x-k8s.io"
SANDBOX_V1ALPHA1: Final = f"{SANDBOX_GROUP}/v1alpha1"
"""Suspended with ``spec.replicas: 0``; a task's where the cluster serves no v1beta1."""
SANDBOX_V1BETA1: Final = f"{SANDBOX_GROUP}/v1beta1"
"""Suspended with ``spec.operatingMode: Suspended``; a task's where the cluster serves it
(``lifecycle.default_sandbox_api_version``)."""
SANDBOX_API_VERSIONS: Final = (SANDBOX_V1ALPHA1, SANDBOX_V1BETA1)
SANDBOX_PLURAL: Final = "sandboxes"
SANDBOX_KIND: Final = "Sandbox"
SANDBOX_CRD: Final = f"{SANDBOX_PLURAL}.{SANDBOX_GROUP}"
"""The Sandbox CRD's object name (``<plural>.<group>``)."""
SANDBOX_SUFFIX: Final = "-sbx"


TASK_NAME_MAX: Final = 63
"""A task's name is the value of ``TASK_LABEL`` on everything made for it: a label value
is at most 63 characters, so the CRD refuses longer names."""


def upstream_sandbox_name(task: str) -> str:
    """``<task>-sbx``: how caliban-operator names the Sandbox it makes for a task (its
    ``sandbox_name``; checked against its source in tests/unit/test_upstream_compat.py)."""
    return f"{task}{SANDBOX_SUFFIX}"


def sandbox_name(task: str, existing: str | None = None) -> str:
    """The Sandbox a task runs in: ``existing`` (its ``spec.sandbox.name``, a Sandbox
    someone else made) when set, else the one the operator makes: ``<task>-sbx``, as
    caliban-operator names its children (``upstream_sandbox_name``; checked against its
    source in tests/unit/test_upstream_compat.py), where that is a valid Service name
    (agent-sandbox names the Sandbox's Service after it); else one that is, the task's
    name made valid and cut, then 8 hex digits of its hash (``a.b`` → ``a-b-<hash>-sbx``).
    The one place the rule lives, so the operator, the audit and the tests cannot
    disagree on it."""
    if existing:
        return existing
    plain = upstream_sandbox_name(task)
    if is_dns1035_label(plain):
        return plain
    digest = hashlib.sha256(task.encode()).hexdigest()[:8]
    stem = re.sub(r"[^a-z0-9-]+", "-", task.lower()).strip("-")
    if not stem[:1].isalpha():
        stem = f"t-{stem}"
    stem = stem[: 63 - len(SANDBOX_SUFFIX) - len(digest) - 1].rstrip("-")
    return f"{stem}-{digest}{SANDBOX_SUFFIX}"


def sandbox_suspended(api_version: str, sandbox: Mapping[str, Any]) -> bool:
    """Whether a Sandbox read at ``api_version`` asks for no pod: ``spec.operatingMode:
    Suspended`` at v1beta1, ``spec.replicas: 0`` at v1alpha1 (unset is running in both).
    The one place the rule lives, for the operator's audit, the stand-in controller, the
    embedded API's conversion and the demo."""
    spec = sandbox.get("spec") or {}
    if api_version == SANDBOX_V1BETA1:
        return bool(spec.get("operatingMode", "Running") == "Suspended")
    return bool(spec.get("replicas", 1) == 0)


TASK_UID_LABEL: Final = f"{GROUP}/task-uid"
"""On a checkpoint's VolumeSnapshot: the uid of the task whose workspace it copies."""

# ------------------------------------------------------------ CSI volume snapshots

SNAPSHOT_GROUP: Final = "snapshot.storage.k8s.io"
SNAPSHOT_VERSION: Final = "v1"
SNAPSHOT_API_VERSION: Final = f"{SNAPSHOT_GROUP}/{SNAPSHOT_VERSION}"
SNAPSHOT_PLURAL: Final = "volumesnapshots"
SNAPSHOT_KIND: Final = "VolumeSnapshot"
SNAPSHOT_CLASS_PLURAL: Final = "volumesnapshotclasses"
SNAPSHOT_CONTENT_PLURAL: Final = "volumesnapshotcontents"
SNAPSHOT_CRD: Final = f"{SNAPSHOT_PLURAL}.{SNAPSHOT_GROUP}"
DEFAULT_SNAPSHOT_CLASS_ANNOTATION: Final = "snapshot.storage.kubernetes.io/is-default-class"
"""``"true"`` on the VolumeSnapshotClass a driver's snapshots use when none is named."""
DEFAULT_STORAGE_CLASS_ANNOTATION: Final = "storageclass.kubernetes.io/is-default-class"

# ------------------------------------------------------------------ the daemon's pod

WORKSPACE_MOUNT: Final = "/workspace"
"""Where the daemon's container mounts the workspace PVC (its ``--store``)."""
RUN_VOLUME: Final = "run"
"""The pod's emptyDir for the daemon's control socket."""
RUN_MOUNT: Final = "/run/caliband"
DAEMON_SOCKET_FILE: Final = "ctl.sock"
"""In :data:`RUN_MOUNT`: the daemon's control socket (``kubectl exec … drainctl agents
--socket /run/caliband/ctl.sock …``)."""
DAEMON_METRICS_PORT: Final = 9102
"""The daemon container's port (named ``metrics``): ``/metrics``, and ``/healthz`` and
``/readyz`` for its probes; the daemon's own default (``DRAIN_DAEMON_METRICS_PORT``)."""
DAEMON_LIVENESS_PROBE: Final = {
    "httpGet": {"path": "/healthz", "port": "metrics"},
    "periodSeconds": 20, "timeoutSeconds": 5, "failureThreshold": 3,
}  # fmt: skip
"""A daemon whose supervisor loop has stopped ticking for a minute is restarted (its
agents then resume through the disruption path); a lost broker never fails it."""
DAEMON_READINESS_PROBE: Final = {
    "httpGet": {"path": "/readyz", "port": "metrics"},
    "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3,
}  # fmt: skip
"""Ready while the control socket answers and the consumer reaches the broker."""
DAEMON_CONTAINER: Final = "caliband"
"""The daemon's container in the task's pod: the only one (besides the Workspace's init
container), and the one ``spec.sandbox.podTemplate`` may give resources."""
DAEMON_GID: Final = 10001
"""The daemon image's group (the Dockerfile's ``USER 10001:10001``): the pod's
``fsGroup``, so the workspace volume is writable by the daemon whatever its uid."""
POD_SECURITY_CONTEXT: Final = {
    "runAsNonRoot": True, "fsGroup": DAEMON_GID, "seccompProfile": {"type": "RuntimeDefault"},
}  # fmt: skip
"""The task pod's security context: Pod Security ``restricted`` (docs/security.md)."""
CONTAINER_SECURITY_CONTEXT: Final = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
}
"""Every container of the task pod: no privilege, no capability, nothing written outside
its volumes (the workspace, the run directory and ``TMP_VOLUME`` at /tmp)."""
TMP_VOLUME: Final = "tmp"
TMP_MOUNT: Final = "/tmp"
COMPONENT_LABEL: Final = "app.kubernetes.io/component"
DAEMON_COMPONENT: Final = "caliban-daemon"
"""``COMPONENT_LABEL`` on every daemon pod, whatever its task: what the daemon
NetworkPolicy in ``deploy/base`` selects."""
BROKER_URL_ENV: Final = "DRAIN_BROKER_URL"
BROKER_SECRET_KEY: Final = "url"  # noqa: S105 - a key name, not a secret
"""The key of the daemon broker Secret (``Settings.daemon_broker_secret``) holding the
URL; the daemon container reads it into ``BROKER_URL_ENV`` through a ``secretKeyRef``."""
