"""The task's ServiceAccount and NetworkPolicy as caliban-operator makes them
(``<task>-sa``, ``<task>-netpol``): pure builders, so the shapes are table-tested apart
from the API calls that create them.

Both are created with the Sandbox (Reconciler.create_sandbox), owned by the task.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from orchestrator.operator import crd

SA_SUFFIX = "-sa"
NETPOL_SUFFIX = "-netpol"
DNS_PORT = 53
_DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "amqp": 5672, "amqps": 5671}


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


def service_account(task: str, namespace: str, owner: dict[str, Any]) -> dict[str, Any]:
    """The pod's identity: no token mounted, bound to no Role (the daemon calls no API)."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {
            "name": service_account_name(task),
            "namespace": namespace,
            "ownerReferences": [owner],
            "labels": {crd.TASK_LABEL: task},
        },
        "automountServiceAccountToken": False,
    }


def network_policy(
    task: str,
    namespace: str,
    owner: dict[str, Any],
    broker_url: str,
    workspace_ports: Sequence[int] = (),
) -> dict[str, Any]:
    """The task's pod takes connections only on the daemon's metrics port (what the
    metrics scrape needs, as deploy/task-namespace/daemon-networkpolicy.yaml allows) and
    reaches only DNS, the broker's port and ``workspace_ports`` (its Workspace provider's
    and git remotes', ``workspace.egress_ports``)."""
    egress: list[dict[str, Any]] = [
        {"ports": [{"protocol": "UDP", "port": DNS_PORT}, {"protocol": "TCP", "port": DNS_PORT}]},
        {"ports": [{"protocol": "TCP", "port": broker_port(broker_url)}]},
    ]
    if workspace_ports:
        egress.append({"ports": [{"protocol": "TCP", "port": p} for p in workspace_ports]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": network_policy_name(task),
            "namespace": namespace,
            "ownerReferences": [owner],
            "labels": {crd.TASK_LABEL: task},
        },
        "spec": {
            "podSelector": {"matchLabels": {crd.TASK_LABEL: task}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"ports": [{"protocol": "TCP", "port": crd.DAEMON_METRICS_PORT}]}],
            "egress": egress,
        },
    }


NAMED_LISTS: frozenset[str] = frozenset({
    "containers", "initContainers", "ephemeralContainers", "volumes", "env", "envFrom",
    "volumeMounts", "volumeDevices", "ports", "imagePullSecrets", "resourceClaims",
})  # fmt: skip
"""The pod-spec lists whose items are keyed by ``name`` (a strategic merge's keys)."""


def merge_under(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
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
