"""What the operator may do in the Kubernetes API, and what it says when it may not.

:data:`PERMISSIONS` is every RBAC permission the operator's code uses — its own calls
(``kube``) and kopf's (watching CalibanTasks, patching their finalizers and annotations,
posting events, peering) — with the code that uses each. ``deploy/base/rbac.yaml``'s
ClusterRole holds exactly these rules (``tests/e2e/test_rbac.py`` keeps the two equal and
checks both against the calls a recorded run makes; :data:`UNREACHED` lists, with the
code path, the verbs that run does not reach).

At startup (kopf's startup handler, ``handlers.configure``) :func:`check_startup` asks the
API, with one SelfSubjectAccessReview per verb, whether the operator's identity holds
each permission its configuration uses; if any is refused it raises
:class:`MissingPermissions`, naming each one, and ``drainctl operator`` exits non-zero
with that line instead of kopf retrying forbidden watches forever. At runtime,
:func:`forbidden_reported` turns a 403 from any call into a log line and a Warning event
naming the permission.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import kopf

from orchestrator.operator import crd
from orchestrator.operator.crd import Manifest
from orchestrator.settings import Settings

log = logging.getLogger(__name__)

RBAC_FILE: Final = "deploy/base/rbac.yaml"
BROKER_SECRET: Final = str(Settings.model_fields["daemon_broker_secret"].default)
"""The Secret the daemon pods read the broker URL from (``DRAIN_DAEMON_BROKER_SECRET``'s
default); the only Secret the operator may read or change. A deployment that renames it
renames it in the ClusterRole too; the startup check asks for the configured name."""


class Need(enum.Enum):
    """Which configuration uses a permission."""

    ALWAYS = "always"
    MANAGE_SANDBOX = "manage-sandbox"  # drainctl operator --manage-sandbox
    SNAPSHOTS = "snapshots"  # --manage-sandbox with DRAIN_SNAPSHOTS (the default)
    PEERING = "peering"  # drainctl operator --peering NAME
    WORKSPACE_STATUS = "workspace-status"  # Settings.writes_workspace_status


@dataclass(frozen=True)
class Permission:
    """One RBAC rule: ``verbs`` on ``resource`` (``plural`` or ``plural/subresource``) of
    API group ``group``, cluster-wide; only on ``resource_names`` when it lists any."""

    group: str
    resource: str
    verbs: tuple[str, ...]
    used_by: str
    need: Need = Need.ALWAYS
    resource_names: tuple[str, ...] = ()

    def rule(self) -> Manifest:
        """As a ClusterRole rule."""
        rule: Manifest = {
            "apiGroups": [self.group],
            "resources": [self.resource],
            "verbs": list(self.verbs),
        }
        if self.resource_names:
            rule["resourceNames"] = list(self.resource_names)
        return rule


PERMISSIONS: Final = (
    Permission(crd.GROUP, crd.PLURAL, ("get", "list", "watch", "patch"),
               "kopf watches CalibanTasks (list, watch) and patches their finalizer and "
               "progress annotations (patch); restore.holder_of reads the task that owns "
               "a workspace PVC (kube.get_task)"),
    Permission(crd.GROUP, crd.WORKSPACE_PLURAL, ("get", "list", "watch"),
               "kube.get_workspace: the Workspace a task's spec.workspaceRef names, read "
               "until its binding is pinned in the task's status (never its providers' "
               "Secrets: the pod reads those through secretKeyRef); kopf watches "
               "Workspaces (list, watch) for handlers.workspace_observed"),
    Permission(crd.GROUP, f"{crd.WORKSPACE_PLURAL}/status", ("patch",),
               "kube.patch_workspace_status: each Workspace's phase, message, "
               "observedGeneration and Ready condition (workspace_status), where "
               "DRAIN_WORKSPACE_STATUS says this operator writes them",
               Need.WORKSPACE_STATUS),
    Permission(crd.GROUP, f"{crd.PLURAL}/status", ("patch",),
               "kopf's status patches of every handler; kube.patch_task_status"),
    Permission("", "events", ("create",),
               "kopf.info/kopf.warn post the phase and drain events, kube.post_event the "
               "snapshot follower's (core v1 events)"),
    Permission("", "namespaces", ("get",),
               "kube.namespace_terminating: the drain finalizer reads whether the task's "
               "namespace is being deleted (nothing can be created there then)"),
    Permission("apiextensions.k8s.io", "customresourcedefinitions", ("get", "list", "watch"),
               "kopf's resource scanning (list, watch); kube.sandbox_api and "
               "kube.snapshots_served read the Sandbox and VolumeSnapshot CRDs (get)"),
    Permission(crd.SANDBOX_GROUP, crd.SANDBOX_PLURAL, ("get", "list", "watch", "create", "patch"),
               "kube.apply_sandbox (server-side apply: create, patch), kube.get_sandbox, "
               "kube.patch_sandbox (suspend, resume); "
               "handlers.child_changed watches them (list, watch); v1alpha1 or v1beta1 "
               "(RBAC does not tell versions apart)", Need.MANAGE_SANDBOX),
    Permission("", "persistentvolumeclaims", ("get", "list", "watch", "create", "patch"),
               "kube.get_pvc, kube.ensure_pvc (create, patch), kube.retain_pvc and "
               "kube.claim_pvc (patch ownerReferences); handlers.child_changed watches them "
               "(list, watch); a released PVC goes by garbage collection, never by the "
               "operator's delete", Need.MANAGE_SANDBOX),
    Permission("", "pods", ("list", "watch"),
               "kube.pods_mounting (restore.last_pod_on): no second daemon on a workspace "
               "PVC a pod still mounts; kube.task_pods: a pod made from another template "
               "than the spec's is rolled; handlers.child_changed watches them",
               Need.MANAGE_SANDBOX),
    Permission("policy", "poddisruptionbudgets", ("create", "delete"),
               "kube.guard_against_eviction: the drain guard PDB while a drain runs",
               Need.MANAGE_SANDBOX),
    Permission("", "serviceaccounts", ("create", "patch"),
               "kube.apply_service_account (server-side apply: create, patch): the task's "
               "<task>-sa ServiceAccount its pod runs "
               "as (no token, no Role); it goes with the task by garbage collection",
               Need.MANAGE_SANDBOX),
    Permission("networking.k8s.io", "networkpolicies", ("create", "patch"),
               "kube.apply_network_policy (server-side apply: create, patch): the task's "
               "<task>-netpol (its pod reaches only "
               "DNS, the broker and its Workspace's remotes); it goes with the task by "
               "garbage collection", Need.MANAGE_SANDBOX),
    Permission("", "secrets", ("create",),
               "kube.ensure_broker_secret: the daemon broker Secret created in a task's "
               "namespace (a create cannot be limited to a name)", Need.MANAGE_SANDBOX),
    Permission("", "secrets", ("get", "patch"),
               f"kube.ensure_broker_secret: the daemon broker Secret {BROKER_SECRET} read and "
               "kept up to date, by name only", Need.MANAGE_SANDBOX,
               resource_names=(BROKER_SECRET,)),
    Permission(crd.SNAPSHOT_GROUP, crd.SNAPSHOT_PLURAL, ("get", "list", "create"),
               "kube.create_snapshot, kube.get_snapshot, kube.list_checkpoint_snapshots: the "
               "workspace snapshot of each checkpoint, those deletions wait for and those "
               "the snapshot follower follows listed by their checkpoint label (drainctl "
               "ledger prune deletes them, not the operator)",
               Need.SNAPSHOTS),
    Permission(crd.SNAPSHOT_GROUP, crd.SNAPSHOT_CLASS_PLURAL, ("list",),
               "kube.snapshot_classes: the class for the PVC's CSI driver", Need.SNAPSHOTS),
    Permission("storage.k8s.io", "storageclasses", ("get", "list"),
               "kube.storage_driver: the CSI driver of the PVC's StorageClass (get by name, "
               "list for the default one)", Need.SNAPSHOTS),
    Permission("kopf.dev", "clusterkopfpeerings", ("list", "watch", "patch"),
               "kopf peering (--peering, clusterwide as deployed): watch the peers, patch "
               "this replica's keep-alive", Need.PEERING),
)  # fmt: skip

UNREACHED: Final[Mapping[tuple[str, str, str], str]] = {
    (crd.GROUP, crd.WORKSPACE_PLURAL, "get"):
        "provisioning.bind_workspace → kube.get_workspace: a task with spec.workspaceRef "
        "(tests/e2e/test_workspace.py runs one; the recorded run's tasks name none)",
    (crd.GROUP, crd.PLURAL, "get"):
        "restore.holder_of → kube.get_task: restoring a checkpoint without a snapshot "
        "whose workspace PVC another task still owns (the recorded run has snapshots)",
    ("", "secrets", "patch"):
        "kube.ensure_broker_secret: the Secret holds another broker URL (the operator's "
        "daemon broker URL changed since it was written)",
    ("storage.k8s.io", "storageclasses", "get"):
        "kube.storage_driver: a PVC that names its StorageClass (the dev stack's name none)",
}  # fmt: skip
"""Granted verbs a recorded lifecycle run does not make, each with the code that does."""


def active(need: Iterable[Need]) -> list[Permission]:
    wanted = set(need)
    return [p for p in PERMISSIONS if p.need in wanted]


def needs_of(
    *, manage_sandbox: bool, snapshots: bool, peering: bool, workspace_status: bool = False
) -> list[Need]:
    """The needs of a configuration of ``drainctl operator`` (``workspace_status``:
    ``Settings.writes_workspace_status``)."""
    needs = [Need.ALWAYS]
    if workspace_status:
        needs.append(Need.WORKSPACE_STATUS)
    if manage_sandbox:
        needs.append(Need.MANAGE_SANDBOX)
        if snapshots:
            needs.append(Need.SNAPSHOTS)
    if peering:
        needs.append(Need.PEERING)
    return needs


def describe(group: str, resource: str, verb: str, namespace: str = "", name: str = "") -> str:
    """``patch calibantasks/status (caliban.caliban-ai.dev) cluster-wide``."""
    where = f'in namespace "{namespace}"' if namespace else "cluster-wide"
    named = f' named "{name}"' if name else ""
    return f"{verb} {resource}{named} ({group or 'core'}) {where}"


class MissingPermissions(kopf.PermanentError):
    """The operator's identity lacks RBAC permissions it needs; one line names them.
    Permanent: kopf stops instead of retrying the startup handler."""

    def __init__(self, missing: Sequence[str]) -> None:
        self.missing = list(missing)
        noun = "permission" if len(missing) == 1 else "permissions"
        super().__init__(f"the operator lacks RBAC {noun}: {'; '.join(missing)}; see {RBAC_FILE}")


Review = Callable[[Mapping[str, str]], bool]
"""Asks the API whether these resourceAttributes are allowed."""


def missing_permissions(permissions: Iterable[Permission], review: Review) -> list[str]:
    """Every (permission, verb) ``review`` refuses, described."""
    missing = []
    for permission in permissions:
        resource, _, subresource = permission.resource.partition("/")
        for verb in permission.verbs:
            for name in permission.resource_names or ("",):
                attributes = {"verb": verb, "group": permission.group, "resource": resource}
                if subresource:
                    attributes["subresource"] = subresource
                if name:
                    attributes["name"] = name
                if not review(attributes):
                    missing.append(describe(permission.group, permission.resource, verb, "", name))
    return missing


def api_review(attributes: Mapping[str, str]) -> bool:
    """One SelfSubjectAccessReview through the official client's default configuration."""
    from kubernetes import client

    body = {"spec": {"resourceAttributes": dict(attributes)}}
    answer = client.AuthorizationV1Api().create_self_subject_access_review(body)
    return bool(answer.status.allowed)


def check_startup(
    needs: Iterable[Need], review: Review = api_review, *, broker_secret: str = BROKER_SECRET
) -> None:
    """Raise :class:`MissingPermissions` unless every active permission is granted (the
    broker Secret's by its configured name ``broker_secret``)."""
    asked = [
        dataclasses.replace(p, resource_names=(broker_secret,)) if p.resource_names else p
        for p in active(needs)
    ]
    missing = missing_permissions(asked, review)
    if missing:
        error = MissingPermissions(missing)
        log.error("rbac_missing %s", error)
        raise error
    log.info("rbac_checked permissions=%d", sum(len(p.verbs) for p in active(needs)))


def find_missing(exc: BaseException) -> MissingPermissions | None:
    """The :class:`MissingPermissions` behind ``exc`` (kopf wraps a startup handler's
    failure in its own error, the cause kept)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, MissingPermissions):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


NAMESPACE_TERMINATING_CAUSE: Final = "NamespaceTerminating"
"""The cause of the 403 with which the API's NamespaceLifecycle admission refuses to
create anything in a namespace being deleted (``v1.NamespaceTerminatingCause``)."""


def _status_of(exc: BaseException) -> Manifest:
    try:
        body = json.loads(getattr(exc, "body", "") or "{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def refused_as_terminating(exc: BaseException) -> bool:
    """Whether ``exc`` is the API refusing a create because the namespace is being
    deleted: a rule of the cluster, not a missing permission. Told by the Status's cause
    (``NamespaceTerminating``), or by its message where a server gives no cause."""
    if getattr(exc, "status", None) != 403:
        return False
    status = _status_of(exc)
    causes = (status.get("details") or {}).get("causes") or []
    if any(c.get("reason") == NAMESPACE_TERMINATING_CAUSE for c in causes if isinstance(c, dict)):
        return True
    return "because it is being terminated" in str(status.get("message", ""))


def forbidden_permission(exc: BaseException) -> str | None:
    """For a 403 of the official client: the permission the API refused, described from
    its Status message (``... cannot patch resource "x" in API group "g" ...``); None for
    any other error, and for a create refused in a namespace being deleted."""
    if getattr(exc, "status", None) != 403 or refused_as_terminating(exc):
        return None
    message = str(_status_of(exc).get("message", ""))
    return message or str(getattr(exc, "reason", "Forbidden"))


@contextlib.contextmanager
def forbidden_reported(post_warning: Callable[[str], None]) -> Iterator[None]:
    """Around a handler: a 403 from the API is logged and posted (``post_warning``) as
    ``the operator lacks RBAC permission: <what the API said>``, then re-raised, so
    kopf retries it as before."""
    try:
        yield
    except Exception as exc:
        refused = forbidden_permission(exc)
        if refused is not None:
            line = f"the operator lacks RBAC permission: {refused}; see {RBAC_FILE}"
            log.error("rbac_forbidden %s", line)
            with contextlib.suppress(Exception):
                post_warning(line)
        raise
