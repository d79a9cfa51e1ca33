"""A CalibanTask's status as the operator reads and writes it.

``TaskStatus`` is the status read once per pass, typed, its camelCase fields by their
Python names (``checkpoint_ref`` is ``status.checkpointRef``); a field of the wrong type
(a hand edit, another writer) reads as unset rather than failing the pass, and fields
this operator does not know are kept as they are (caliban-operator's among them).
``StatusWrite`` is what one pass may set: a ``TypedDict``, so a misspelt field or a value
of the wrong type is a type error, not a silent new key. A pass's patch is the diff of
what it set against what it read (``lifecycle.status_patch``): a task at rest writes
nothing.
"""

from __future__ import annotations

from pydantic import AliasGenerator, BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel
from typing_extensions import TypedDict

from orchestrator.operator.crd import Manifest
from orchestrator.operator.lifecycle import Condition


class LastOperation(TypedDict, total=False):
    id: str
    kind: str
    state: str
    error: str
    startedAt: str
    finishedAt: str


"""``status.lastOperation``: the task's latest ledger operation."""

Scaling = TypedDict("Scaling", {"operation": str, "from": int, "to": int}, total=False)
"""``status.scaling``: the scale operation on its way, and its counts."""


def _alias(name: str) -> str:
    return "serviceFQDN" if name == "service_fqdn" else to_camel(name)


class StatusWrite(TypedDict, total=False):
    """The status fields a pass sets, by their Python names; None removes a field."""

    phase: str
    phase_since: str | None
    message: str
    agents: int
    applied_agents: int
    checkpoint_ref: str | None
    checkpoint_agents: int | None
    pvc_name: str
    sandbox_name: str
    sandbox_api_version: str | None
    service_fqdn: str | None
    idle_since: str | None
    paused_by: str | None
    pauses: int
    rolls: int
    completions: int
    scales: int
    scaling: Scaling | None
    recoveries: int
    recovery_streak: int
    last_recovery_at: str | None
    disrupted_at: str | None
    disruption: str | None
    last_wake: str | None
    last_suspend: bool
    failed_generation: int | None
    observed_generation: int | None
    applied_generation: int | None
    drain_guard: bool
    last_operation: LastOperation
    conditions: list[Condition]
    resolved_workspace: Manifest


class TaskStatus(BaseModel):
    """``status`` as read at the start of a pass (the fields of ``StatusWrite``)."""

    model_config = ConfigDict(
        alias_generator=AliasGenerator(validation_alias=_alias, serialization_alias=_alias),
        populate_by_name=True,
        extra="allow",
        frozen=True,
    )

    phase: str | None = None
    phase_since: str | None = None
    message: str | None = None
    agents: int | None = None
    applied_agents: int | None = None
    checkpoint_ref: str | None = None
    checkpoint_agents: int | None = None
    pvc_name: str | None = None
    sandbox_name: str | None = None
    sandbox_api_version: str | None = None
    service_fqdn: str | None = None
    idle_since: str | None = None
    paused_by: str | None = None
    pauses: int | None = None
    rolls: int | None = None
    completions: int | None = None
    scales: int | None = None
    scaling: Scaling | None = None
    recoveries: int | None = None
    recovery_streak: int | None = None
    last_recovery_at: str | None = None
    disrupted_at: str | None = None
    disruption: str | None = None
    last_wake: str | None = None
    last_suspend: bool | None = None
    failed_generation: int | None = None
    observed_generation: int | None = None
    applied_generation: int | None = None
    drain_guard: bool | None = None
    last_operation: LastOperation | None = None
    conditions: list[Condition] | None = None
    resolved_workspace: Manifest | None = None

    @classmethod
    def read(cls, raw: Manifest) -> TaskStatus:
        """``raw`` typed; a field whose value does not fit its type reads as unset (the
        pass then decides from what it observes, and writes the field anew)."""
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            bad = {str(error["loc"][0]) for error in exc.errors() if error["loc"]}
            return cls.model_validate({k: v for k, v in raw.items() if k not in bad})


def aliased(fields: StatusWrite) -> Manifest:
    """``fields`` under the names the API stores them by (``checkpointRef``)."""
    return {_alias(name): value for name, value in fields.items()}
