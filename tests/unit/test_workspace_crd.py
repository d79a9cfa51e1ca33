"""Our Workspace CRD (``orchestrator/operator/crds/workspace.yaml``, written for this
project) against caliban-operator's own (``tests/fixtures/upstream``): the same API, and
everything upstream's admits is admitted by ours with the same meaning.

The two CRDs have the same name, so installing one replaces the other: a Workspace
stored under upstream's must stay valid under ours and keep every value. Tried with the
embedded API's schema code (``orchestrator.devcluster.schema``: prune, default, validate,
as the dev stack's API server admits a write) on upstream's sample (hosts rewritten to
127.0.0.1 by ``tests.upstream.local_samples``) and on objects generated from upstream's
``openAPIV3Schema``, field by field; and by walking both schemas' property trees.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.devcluster import schema as structural
from orchestrator.operator import crd
from tests import upstream
from tests.unit.test_crd_schema import errors, load_yaml, openapi_schema
from tests.unit.test_upstream_compat import (
    UPSTREAM_WORKSPACE_SCHEMA,
    admitted,
    assert_same_meaning,
    declared_fields,
    described,
    minimal,
    reached_fields,
    variants,
)

REPO = Path(__file__).resolve().parents[2]
OUR_CRD_PATH = REPO / "orchestrator" / "operator" / "crds" / "workspace.yaml"
OUR_CRD = load_yaml(OUR_CRD_PATH)
OUR_WORKSPACE_SCHEMA = openapi_schema(OUR_CRD, "v1alpha1")
UPSTREAM_CRD = upstream.load(upstream.WORKSPACE_CRD)

Schema = dict[str, Any]


def workspace(spec: Any = None, status: Any = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": crd.API_VERSION,
        "kind": crd.WORKSPACE_KIND,
        "metadata": {"name": "ws", "namespace": "team-a"},
        "spec": minimal(UPSTREAM_WORKSPACE_SCHEMA["properties"]["spec"]) if spec is None else spec,
    }
    if status is not None:
        obj["status"] = status
    return obj


def generated() -> Iterator[Any]:
    props = UPSTREAM_WORKSPACE_SCHEMA["properties"]
    for spec in variants(props["spec"]):
        yield pytest.param(workspace(spec=spec), id=f"spec={described(spec)}")
    for status in variants(props["status"]):
        if status is not None:
            yield pytest.param(workspace(status=status), id=f"status={described(status)}")


# --- the API ---------------------------------------------------------------------------


def test_ours_serves_the_same_api_as_upstreams() -> None:
    def api(definition: dict[str, Any]) -> tuple[Any, ...]:
        spec = definition["spec"]
        versions = [
            (v["name"], v["served"], v["storage"], v.get("subresources"))
            for v in spec["versions"]
        ]  # fmt: skip
        names = spec["names"]
        return (definition["metadata"]["name"], spec["group"], spec["scope"], names["kind"],
                names["plural"], names["singular"], names["shortNames"], versions)  # fmt: skip

    assert api(OUR_CRD) == api(UPSTREAM_CRD)
    assert api(OUR_CRD) == (
        "workspaces.caliban.caliban-ai.dev", crd.GROUP, "Namespaced", crd.WORKSPACE_KIND,
        crd.WORKSPACE_PLURAL, "workspace", ["cws"], [("v1alpha1", True, True, {"status": {}})],
    )  # fmt: skip


def test_the_deployed_copy_is_byte_identical() -> None:
    assert (REPO / "deploy" / "crds" / "workspace.yaml").read_bytes() == OUR_CRD_PATH.read_bytes()


def test_the_phase_column_reads_the_same_field_as_upstreams() -> None:
    def columns(definition: dict[str, Any]) -> dict[str, str]:
        [version] = definition["spec"]["versions"]
        return {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}

    theirs, ours = columns(UPSTREAM_CRD), columns(OUR_CRD)
    assert {name: ours.get(name) for name in theirs} == theirs


def descriptions(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "description" and isinstance(value, str):
                yield " ".join(value.split())
            else:
                yield from descriptions(value)
    elif isinstance(node, list):
        for item in node:
            yield from descriptions(item)


def test_ours_is_written_for_this_project_not_copied() -> None:
    """No description of ours is one of upstream's (whose licence is not ours)."""
    ours, theirs = set(descriptions(OUR_CRD)), set(descriptions(UPSTREAM_CRD))
    assert len(ours) > 30 and len(theirs) > 20
    assert ours & theirs == set()


# --- the property trees ----------------------------------------------------------------


def paths(node: Schema, at: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Schema]]:
    """Every node of a schema with its path (``[]`` for a list's items)."""
    yield at, node
    for name, sub in node.get("properties", {}).items():
        yield from paths(sub, (*at, name))
    if isinstance(node.get("items"), dict):
        yield from paths(node["items"], (*at, "[]"))


def incompatibilities(theirs: Schema, ours: Schema) -> list[str]:
    """Where ``ours`` lacks a field of ``theirs`` or would refuse or change a value it
    admits: another type or format, not nullable where it is, a required field or a
    bound it has not, fewer enum values, another default, no status subresource field."""
    found: list[str] = []
    mine = dict(paths(ours))
    for path, node in paths(theirs):
        where = ".".join(path) or "<root>"
        other = mine.get(path)
        if other is None:
            found.append(f"{where}: missing")
            continue
        for key in ("type", "format", "default"):
            if node.get(key) != other.get(key):
                found.append(f"{where}: {key} {other.get(key)!r}, upstream {node.get(key)!r}")
        if node.get("nullable") and not other.get("nullable"):
            found.append(f"{where}: not nullable")
        if extra := set(other.get("required", [])) - set(node.get("required", [])):
            found.append(f"{where}: requires {sorted(extra)} too")
        for bound in ("minLength", "minItems", "minimum"):
            if other.get(bound, 0) > node.get(bound, 0):
                found.append(f"{where}: {bound} {other[bound]} > {node.get(bound, 0)}")
        for bound in ("maxLength", "maxItems", "maximum", "pattern"):
            if bound in other and other[bound] != node.get(bound):
                found.append(f"{where}: {bound} {other[bound]!r}, upstream {node.get(bound)!r}")
        if "enum" in other and not set(node.get("enum", [None])) <= set(other["enum"]):
            found.append(f"{where}: enum {other['enum']}, upstream {node.get('enum')}")
    return found


def test_every_upstream_field_is_in_ours_with_a_compatible_type() -> None:
    assert incompatibilities(UPSTREAM_WORKSPACE_SCHEMA, OUR_WORKSPACE_SCHEMA) == []
    # Not vacuous: the walk covers upstream's whole tree ...
    assert len(list(paths(UPSTREAM_WORKSPACE_SCHEMA))) > 30
    # ... and names what a schema that drifted would get wrong.
    drifted = copy.deepcopy(OUR_WORKSPACE_SCHEMA)
    spec = drifted["properties"]["spec"]["properties"]
    del spec["isolation"]["properties"]["worktrees"]
    spec["providers"]["items"]["properties"]["model"]["nullable"] = False
    spec["sources"]["items"]["properties"]["ref"]["default"] = "master"
    spec["providers"]["minItems"] = 2
    drifted["properties"]["status"]["properties"]["phase"]["enum"] = ["Ready", "Failed"]
    spec["env"]["items"]["properties"]["value"]["type"] = "integer"
    assert incompatibilities(UPSTREAM_WORKSPACE_SCHEMA, drifted) == [
        "spec.env.[].value: type 'integer', upstream 'string'",
        "spec.isolation.worktrees: missing",
        "spec.providers: minItems 2 > 1",
        "spec.providers.[].model: not nullable",
        "spec.sources.[].ref: default 'master', upstream 'main'",
        "status.phase: enum ['Ready', 'Failed'], upstream ['Pending', 'Ready', 'Failed']",
    ]


# --- objects upstream admits -----------------------------------------------------------


def test_upstreams_sample_workspace_is_admitted_by_ours_unchanged() -> None:
    sample = upstream.local_samples()["workspace.yaml"]
    ours = assert_same_meaning(sample, UPSTREAM_WORKSPACE_SCHEMA, OUR_WORKSPACE_SCHEMA)
    assert ours["spec"] == sample["spec"]
    assert [p["kind"] for p in ours["spec"]["providers"]] == ["anthropic", "ollama"]


def test_the_generator_reaches_every_field_of_upstreams_schema() -> None:
    declared = declared_fields(UPSTREAM_WORKSPACE_SCHEMA)
    assert declared - reached_fields(p.values[0] for p in generated()) == set()
    assert len(declared) > 25


@pytest.mark.parametrize("obj", list(generated()))
def test_what_upstream_admits_ours_admits_with_the_same_meaning(obj: dict[str, Any]) -> None:
    assert_same_meaning(obj, UPSTREAM_WORKSPACE_SCHEMA, OUR_WORKSPACE_SCHEMA)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"displayName": ""}, "spec.displayName"),
        ({"sources": []}, "spec.sources"),
        ({"providers": []}, "spec.providers"),
        ({"providers": [{"name": "p"}]}, "spec.providers[0].kind"),
        ({"providers": [{"name": "p", "kind": "ollama", "credentialsRef": {"key": "k"}}]},
         "spec.providers[0].credentialsRef.secretName"),
        ({"sources": [{"name": "s", "repo": "r"}]}, "spec.sources[0].path"),
        ({"env": [{"name": "A"}]}, "spec.env[0].value"),
    ],
)  # fmt: skip
def test_what_both_refuse_ours_refuses_naming_the_field(change: dict[str, Any], field: str) -> None:
    spec = {**minimal(UPSTREAM_WORKSPACE_SCHEMA["properties"]["spec"]), **change}
    obj = workspace(spec=spec)
    assert errors(UPSTREAM_WORKSPACE_SCHEMA, {"spec": spec}), "upstream admits it"
    pruned, _ = structural.prune_and_default(obj, OUR_WORKSPACE_SCHEMA)
    refused = [p.field for p in structural.validate(pruned, OUR_WORKSPACE_SCHEMA)]
    assert field in refused, refused


def test_the_status_this_operator_writes_is_valid_under_both() -> None:
    status = {
        "phase": "Failed", "observedGeneration": 3,
        "message": "Workspace ws: provider planner is of kind anthropic",
        "conditions": [{
            "type": "Ready", "status": "False", "reason": "UnsupportedProviderKind",
            "message": "Workspace ws: provider planner is of kind anthropic",
            "lastTransitionTime": "2026-07-20T10:00:00Z", "observedGeneration": 3,
        }],
    }  # fmt: skip
    ours = admitted(workspace(status=status), OUR_WORKSPACE_SCHEMA)
    assert ours["status"] == status
    # Under upstream's CRD the two condition fields it does not declare are pruned, and
    # the rest stays valid.
    written = workspace(status=status)
    pruned, unknown = structural.prune_and_default(written, UPSTREAM_WORKSPACE_SCHEMA)
    assert sorted(unknown) == [
        "status.conditions[0].lastTransitionTime", "status.conditions[0].observedGeneration",
    ]  # fmt: skip
    assert structural.validate(pruned, UPSTREAM_WORKSPACE_SCHEMA) == []


def test_a_status_without_a_phase_is_pending_in_both() -> None:
    for schema in (UPSTREAM_WORKSPACE_SCHEMA, OUR_WORKSPACE_SCHEMA):
        assert admitted(workspace(status={"observedGeneration": 1}), schema)["status"] == {
            "observedGeneration": 1, "phase": "Pending",
        }  # fmt: skip
