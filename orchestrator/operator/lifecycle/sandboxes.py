"""The Sandbox a task talks to: which API version (pinned once chosen), whether the
cluster can take it, how it is suspended, and what its controller reports (``Ready``,
the Service's FQDN, the workspace PVC it mounts)."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.operator.crd import (
    SANDBOX_API_VERSIONS,
    SANDBOX_CRD,
    SANDBOX_V1ALPHA1,
    SANDBOX_V1BETA1,
    Manifest,
)
from orchestrator.operator.lifecycle.conditions import ConditionChange


@dataclass(frozen=True)
class SandboxApi:
    """What the cluster's Sandbox CRD serves: version names, the storage version, and
    whether a conversion webhook translates between them."""

    served: tuple[str, ...]
    storage: str | None
    converts: bool


def default_sandbox_api_version(api: SandboxApi | None) -> str:
    """The Sandbox API version of a task whose spec names none, from what the cluster
    serves: v1beta1 where it can drive the cluster's Sandboxes, else v1alpha1 where that
    can; where neither can, v1beta1 if served, else v1alpha1 (and
    :func:`sandbox_version_problem` then says why before anything is created)."""
    if api is None:
        return SANDBOX_V1ALPHA1
    for candidate in (SANDBOX_V1BETA1, SANDBOX_V1ALPHA1):
        if sandbox_version_problem(candidate, api) is None:
            return candidate
    return SANDBOX_V1BETA1 if "v1beta1" in api.served else SANDBOX_V1ALPHA1


def sandbox_api_version_choice(
    requested: str | None, pinned: object, *, started: bool
) -> str | None:
    """The Sandbox API version a task talks to its Sandbox in, or None: ask the cluster
    (:func:`default_sandbox_api_version`) and pin the answer in ``status.sandboxApiVersion``.

    ``requested`` (``spec.sandbox.apiVersion``) always wins; else the version pinned when
    the task was first seen, so a task keeps talking to its Sandbox in the version it was
    created with whatever the cluster serves later; else, for a task ``started`` (its
    Sandbox named in its status) with nothing pinned, made before versions were pinned
    when an unset version meant v1alpha1, v1alpha1."""
    if requested is not None:
        return requested
    if isinstance(pinned, str) and pinned in SANDBOX_API_VERSIONS:
        return pinned
    if started:
        return SANDBOX_V1ALPHA1
    return None


def sandbox_version_problem(api_version: str, api: SandboxApi | None) -> str | None:
    """Why the task's ``spec.sandbox.apiVersion`` cannot drive this cluster's Sandboxes,
    or None. Suspension is a different field per version (``replicas`` on v1alpha1,
    ``operatingMode`` on v1beta1): written at a version other than the stored one with
    no webhook to convert it, it would never reach the controller, and the task would
    say Suspended while its daemon kept running."""
    if api is None:
        return f"the cluster has no Sandbox API (CRD {SANDBOX_CRD})"
    version = api_version.partition("/")[2]
    if version not in api.served:
        return (
            f"spec.sandbox.apiVersion {api_version} is not served by this cluster (served: "
            f"{', '.join(api.served) or 'none'})"
        )
    if api.storage is not None and api.storage != version and not api.converts:
        return (
            f"spec.sandbox.apiVersion {api_version}: this cluster stores Sandboxes as "
            f"{api.storage} with no conversion webhook, so a suspension written at {version} "
            f"would not reach its controller; set spec.sandbox.apiVersion to "
            f"{api_version.partition('/')[0]}/{api.storage}"
        )
    return None


def sandbox_workspace_claim(sandbox: Manifest) -> str | None:
    """The PVC an existing Sandbox (``spec.sandbox.name``) mounts, which is then the
    task's workspace (its snapshots and checkpoints copy it): the only
    ``persistentVolumeClaim`` volume of its pod template, or None where it has none or
    several (then nothing says which one the agents write)."""
    pod = ((sandbox.get("spec") or {}).get("podTemplate") or {}).get("spec") or {}
    claims = [
        str(v["persistentVolumeClaim"]["claimName"])
        for v in pod.get("volumes") or []
        if isinstance(v, dict) and (v.get("persistentVolumeClaim") or {}).get("claimName")
    ]
    return claims[0] if len(claims) == 1 else None


def sandbox_readiness(sandbox: Manifest) -> ConditionChange:
    """``SandboxReady`` from the Sandbox's own ``Ready`` condition (its controller's
    reason and message, with the Sandbox named), Unknown while its controller has written
    none: a Sandbox that never becomes Ready is seen on the task, not only on the Sandbox."""
    name = (sandbox.get("metadata") or {}).get("name", "?")
    conditions = (sandbox.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if isinstance(c, dict) and c.get("type") == "Ready"), None)
    if ready is None:
        return ConditionChange(
            "SandboxReady",
            None,
            "NoSandboxStatus",
            f"Sandbox {name} has no Ready condition yet (its controller has not reported)",
        )
    status = {"True": True, "False": False}.get(str(ready.get("status")))
    reason = str(ready.get("reason") or "SandboxReported")
    said = str(ready.get("message") or "").strip()
    state = {True: "is Ready", False: "is not Ready", None: "reports Ready Unknown"}[status]
    return ConditionChange(
        "SandboxReady", status, reason, f"Sandbox {name} {state}" + (f": {said}" if said else "")
    )


def sandbox_service_fqdn(sandbox: Manifest) -> str | None:
    """The Sandbox's ``status.serviceFQDN``, where its controller has written one."""
    fqdn = (sandbox.get("status") or {}).get("serviceFQDN")
    return fqdn if isinstance(fqdn, str) and fqdn else None


def sandbox_suspension_patch(api_version: str, suspended: bool) -> Manifest:
    """The Sandbox spec change that stops (or restarts) its pod, per API version."""
    if api_version == SANDBOX_V1BETA1:
        return {"spec": {"operatingMode": "Suspended" if suspended else "Running"}}
    return {"spec": {"replicas": 0 if suspended else 1}}
