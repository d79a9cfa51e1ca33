"""The spec is declared twice, once for the API server (the CRD's schema) and once for
the operator (``lifecycle.declared``): this walks both, field by field, and fails on any
difference of name, type or default, so neither can drift from the other."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from orchestrator.operator.lifecycle import SpecError, parse_spec
from orchestrator.operator.lifecycle.declared import CalibanTaskSpec

CRD = Path(__file__).resolve().parents[2] / "orchestrator/operator/crds/calibantask.yaml"
OPAQUE = {"spec.sandbox.podTemplate"}
"""Taken whole by the model and judged by ``parse_spec`` (its own allow-list)."""


def crd_spec() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    [version] = crd["spec"]["versions"]
    spec: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec


def _unwrapped(annotation: Any) -> Any:
    """``X | None`` → ``X``."""
    if get_origin(annotation) in (Union, types.UnionType):
        [inner] = [a for a in get_args(annotation) if a is not type(None)]
        return inner
    return annotation


def _kind(annotation: Any) -> str:
    annotation = _unwrapped(annotation)
    origin = get_origin(annotation) or annotation
    if isinstance(origin, type) and issubclass(origin, BaseModel):
        return "object"
    return {str: "string", int: "integer", bool: "boolean", list: "array", dict: "object"}[origin]


def differences(model: type[BaseModel], schema: dict[str, Any], at: str) -> list[str]:
    found = []
    fields = {f.alias or name: f for name, f in model.model_fields.items()}
    crd = schema.get("properties") or {}
    found += [f"{at}.{n}: in the CRD, not the model" for n in sorted(set(crd) - set(fields))]
    found += [f"{at}.{n}: in the model, not the CRD" for n in sorted(set(fields) - set(crd))]
    for name in sorted(set(crd) & set(fields)):
        where, node, field = f"{at}.{name}", crd[name], fields[name]
        kind = _kind(field.annotation)
        if node.get("type") != kind:
            found.append(f"{where}: the CRD says {node.get('type')}, the model {kind}")
        default = None if field.is_required() else field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(exclude_defaults=True)
        # A field the CRD requires is always there: the model's default is only for an
        # object that reaches the operator without the schema.
        required = name in (schema.get("required") or [])
        defaulted = default not in (None, []) or "default" in node
        if not required and defaulted and node.get("default") != default:
            found.append(f"{where}: default {node.get('default')!r} in the CRD, "
                         f"{default!r} in the model")  # fmt: skip
        inner = _unwrapped(field.annotation)
        if get_origin(inner) is list:
            inner = get_args(inner)[0]
            node = node.get("items") or {}
        if isinstance(inner, type) and issubclass(inner, BaseModel) and where not in OPAQUE:
            found += differences(inner, node, where)
    return found


def test_the_crd_and_the_declared_spec_have_the_same_fields_types_and_defaults() -> None:
    assert differences(CalibanTaskSpec, crd_spec(), "spec") == []


def test_the_walk_finds_a_difference_when_there_is_one() -> None:
    schema = crd_spec()
    schema["properties"]["lifecycle"]["properties"]["drainTimeout"]["default"] = "5m"
    del schema["properties"]["isolation"]
    assert differences(CalibanTaskSpec, schema, "spec") == [
        "spec.isolation: in the model, not the CRD",
        "spec.lifecycle.drainTimeout: default '5m' in the CRD, '2m' in the model",
    ]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"task": {"agents": True}}, "task.agents"),
        ({"task": {"agents": 65}}, "task.agents"),
        ({"lifecycle": {"suspend": "yes"}}, "lifecycle.suspend"),
        ({"isolation": {"runtimeClass": 7}}, "isolation.runtimeClass"),
        ({"state": {"tokenRef": {"key": "k"}}}, "state.tokenRef.secretName"),
        ({"tools": ["grep", 3]}, "tools"),
    ],
)
def test_what_the_declared_spec_does_not_take_is_refused_naming_the_field(
    spec: dict[str, Any], field: str
) -> None:
    with pytest.raises(SpecError) as refused:
        parse_spec(spec)
    assert refused.value.field == field


def test_a_null_reads_as_unset_as_caliban_operator_writes_it() -> None:
    spec = parse_spec({"task": {"agents": None, "prompt": None, "model": None},
                       "lifecycle": {"onDelete": None}, "isolation": None})  # fmt: skip
    assert (spec.agents, spec.prompt, spec.model, spec.on_delete) == (1, None, "", "checkpoint")
    assert spec.declared.isolation is None
