"""Status conditions as metav1.Condition (``condition``, ``merge_conditions``), the
status patch of what changed (``status_patch``), and the timestamps status holds."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import NotRequired

from typing_extensions import TypedDict

from orchestrator.operator.crd import Manifest


class Condition(TypedDict):
    """A ``metav1.Condition`` as the status holds it (another writer's may lack the
    optional fields)."""

    type: str
    status: str
    reason: NotRequired[str]
    message: NotRequired[str]
    lastTransitionTime: NotRequired[str | None]
    observedGeneration: NotRequired[int | None]


def parse_time(value: object) -> datetime | None:
    """A timestamp as the status and metadata write it (``2026-12-03T12:00:00Z``), or
    None for anything else."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


@dataclass(frozen=True)
class ConditionChange:
    """A condition to set: ``type`` to ``status`` for ``reason``, explained by ``message``;
    ``status`` None is ``Unknown``."""

    type: str
    status: bool | None
    reason: str
    message: str


def condition(
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
) -> Condition:
    """A ``metav1.Condition``; ``status`` None is ``Unknown``."""
    return {
        "type": type_,
        "status": "Unknown" if status is None else "True" if status else "False",
        "reason": reason,
        "message": message,
        "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "observedGeneration": generation,
    }


def merge_conditions(existing: list[Condition], new: Condition) -> list[Condition]:
    """Replace the condition of the same type; keep lastTransitionTime if status held."""
    out = []
    replaced = False
    for cond in existing:
        if cond.get("type") == new["type"]:
            replaced = True
            if cond.get("status") == new["status"]:
                new = {**new, "lastTransitionTime": cond.get("lastTransitionTime")}
            out.append(new)
        else:
            out.append(cond)
    if not replaced:
        out.append(new)
    return out


def status_patch(current: Manifest, desired: Manifest) -> Manifest:
    """Only the status fields that differ (no-op churn avoidance). A merge patch merges
    an object into the one stored, so an object's keys the new value no longer has are
    sent as null (removed): otherwise they stay, and the field differs at every pass."""
    changed: Manifest = {}
    for key, value in desired.items():
        was = current.get(key)
        if was == value:
            continue
        if isinstance(value, dict) and isinstance(was, dict):
            value = {**dict.fromkeys(was.keys() - value.keys()), **value}
        changed[key] = value
    return changed


def as_stored(patch: Manifest) -> Manifest:
    """``patch``'s fields as the API stores them once merged: an object's null keys gone
    (a null field itself is kept: it reads as unset)."""
    return {
        k: {sub: v for sub, v in value.items() if v is not None}
        if isinstance(value, dict)
        else value
        for k, value in patch.items()
    }
