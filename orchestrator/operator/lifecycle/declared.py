"""The CalibanTask spec as declared: the CRD's ``spec`` as pydantic models, field by field
under its camelCase names, with the CRD's defaults. ``CalibanTaskSpec.read`` takes an
object's spec once per pass; ``spec.parse_spec`` then applies what a schema cannot say
(durations, checkpoint refs, the pod template's allow-list) into the flat ``TaskSpec``.

The CRD (``crds/calibantask.yaml``) and these models describe the same fields with the
same defaults: ``tests/unit/test_declared_spec.py`` walks both and fails on any
difference. caliban-operator's schema makes its fields nullable and reads a null as
unset; so does ``read``. Fields this operator does not act on yet (``agentType``,
``isolation``, ``state``, ``model``, ``resources``, ``tools``) are declared here so
they are read, typed, and never silently lost.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from orchestrator.operator.crd import Manifest


class _Declared(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", strict=True, frozen=True
    )


class EnvVar(_Declared):
    name: str
    value: str | None = None


class TaskSection(_Declared):
    agents: int = Field(default=1, ge=1, le=64)
    provider: str = "scripted"
    model: str | None = None
    prompt: str | None = Field(default=None, min_length=1)
    agent_type: str | None = None
    interactive: bool | None = None
    image: str | None = None
    env: list[EnvVar] = []


class LifecycleSection(_Declared):
    idle_timeout: str | None = None
    on_delete: str = "checkpoint"
    drain_grace_period: str = "30s"
    drain_timeout: str = "2m"
    suspend: bool = False


class ResumeFrom(_Declared):
    checkpoint_ref: str


class SandboxSection(_Declared):
    api_version: str | None = None
    name: str | None = None
    pod_template: Manifest | None = None


class WorkspaceSection(_Declared):
    storage: str = "1Gi"
    storage_class_name: str | None = None


class WorkspaceRef(_Declared):
    name: str


class ModelSection(_Declared):
    router_config_ref: str | None = None


class SecretKey(_Declared):
    secret_name: str
    key: str


class StateSection(_Declared):
    gonzalo_endpoint: str | None = None
    mode: str | None = None
    token_ref: SecretKey | None = None


class IsolationSection(_Declared):
    runtime_class: str | None = None
    worktrees: str | None = None


class ResourcesSection(_Declared):
    class_: str | None = Field(default=None, alias="class")


class CalibanTaskSpec(_Declared):
    """``spec`` of a CalibanTask, every section defaulted as the CRD defaults it."""

    task: TaskSection = TaskSection()
    """Required by the CRD (as caliban-operator requires it); defaulted here for an
    object that reaches the operator without the schema (an older CRD)."""
    lifecycle: LifecycleSection = LifecycleSection()
    resume_from: ResumeFrom | None = None
    sandbox: SandboxSection = SandboxSection()
    workspace: WorkspaceSection = WorkspaceSection()
    workspace_ref: WorkspaceRef | None = None
    provider_ref: str | None = None
    model: ModelSection | None = None
    state: StateSection | None = None
    isolation: IsolationSection | None = None
    resources: ResourcesSection | None = None
    tools: list[str] | None = None

    @classmethod
    def read(cls, spec: Manifest) -> CalibanTaskSpec:
        """``spec`` as declared; a null reads as unset. Raises ``DeclaredError`` naming
        the first field that does not fit (``task.agents``; a list's own field for a
        bad item: ``task.env``)."""
        try:
            return cls.model_validate(_without_nulls(spec))
        except ValidationError as exc:
            first = exc.errors()[0]
            raise DeclaredError(_path(first["loc"]), first["msg"], first.get("input")) from None


class DeclaredError(ValueError):
    """A field whose value the declared spec does not take: ``field`` its path."""

    def __init__(self, field: str, why: str, value: object) -> None:
        super().__init__(f"{value!r}: {why[:1].lower()}{why[1:]}")
        self.field = field


def _without_nulls(value: Any) -> Any:
    """What the API server does to a null under a non-nullable schema: prunes it."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a spec field: its camelCase names joined by dots, up
    to the first list index (an item is named by its list)."""
    names = []
    for part in loc:
        if isinstance(part, int):
            break
        names.append(str(part))
    return ".".join(names)
