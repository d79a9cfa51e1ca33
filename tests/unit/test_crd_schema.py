"""The CalibanTask CRD, agent-sandbox's Sandbox CRD and the sample manifests, checked offline.

There is no API server here, so the CRD's ``openAPIV3Schema`` is translated into draft-4
JSON Schema (what OpenAPI v3.0 schemas are built on) and checked with ``jsonschema``:

* ``x-kubernetes-*`` keywords are dropped; ``x-kubernetes-preserve-unknown-fields`` nodes
  accept any field, every other object with ``properties`` rejects unknown fields, which
  is what ``kubectl``'s default ``--validate=strict`` (server-side field validation) does.
* ``format: date-time`` is checked leniently (anything ``datetime.fromisoformat`` reads
  after mapping ``Z`` to ``+00:00``); ``int32``/``int64`` formats are not checked.
* ``default`` is applied by :func:`apply_defaults`, the way the API server's structural
  defaulting does it.

The ``kubectl`` checks use ``kubectl label --local``: ``kubectl apply --dry-run=client``
and ``kubectl create --dry-run=client`` still ask a server for API discovery (they fail
with "connection refused" without one), while ``--local`` parses and prints the manifest
without contacting anything.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
# The packaged CRDs (the sources; deploy/crds/ holds identical copies, see test_packaging).
CRD_PATH = REPO / "orchestrator" / "operator" / "crds" / "calibantask.yaml"
SANDBOX_CRD_PATH = (
    REPO / "orchestrator" / "devcluster" / "crds" / "agent-sandbox"
    / "agents.x-k8s.io_sandboxes.yaml"
)  # fmt: skip
"""agent-sandbox's own Sandbox CRD (v0.5.6), as the dev stack serves it."""
UPSTREAM_SANDBOX_CRD_PATH = (
    REPO / "tests" / "fixtures" / "upstream" / "agent-sandbox" / "k8s" / "crds"
    / "agents.x-k8s.io_sandboxes.yaml"
)  # fmt: skip
SAMPLES_DIR = REPO / "deploy" / "samples"
SAMPLES = sorted(SAMPLES_DIR.glob("*.yaml"))

GROUP = "caliban.caliban-ai.dev"
API_VERSION = f"{GROUP}/v1alpha1"
PHASES = [
    "Pending",
    "Provisioning",
    "Running",
    "Draining",
    "Suspended",
    "Resuming",
    "Completed",
    "Failed",
]

Schema = dict[str, Any]

FORMATS = jsonschema.FormatChecker(formats=())


@FORMATS.checks("date-time", raises=ValueError)
def _is_date_time(value: object) -> bool:
    if isinstance(value, str):
        datetime.fromisoformat(value.replace("Z", "+00:00"))
    return True


# --- loading and translating ---------------------------------------------------------


def load_yaml(path: Path) -> dict[str, Any]:
    loaded = yaml.safe_load(path.read_text())
    assert isinstance(loaded, dict), f"{path.name} is not one YAML mapping"
    return loaded


def crd_version(crd: dict[str, Any], name: str) -> dict[str, Any]:
    matches = [v for v in crd["spec"]["versions"] if v["name"] == name]
    assert len(matches) == 1, f"{crd['metadata']['name']} has no single version {name}"
    version: dict[str, Any] = matches[0]
    return version


def openapi_schema(crd: dict[str, Any], version: str) -> Schema:
    schema: Schema = crd_version(crd, version)["schema"]["openAPIV3Schema"]
    return schema


def to_json_schema(node: Schema) -> Schema:
    """Translate a Kubernetes structural schema node into draft-4 JSON Schema."""
    out: Schema = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key == "properties":
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = to_json_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [to_json_schema(sub) for sub in value]
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
    if "properties" in node and "additionalProperties" not in node and not preserve:
        out["additionalProperties"] = False
    return out


def validator_for(schema: Schema) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(to_json_schema(schema), format_checker=FORMATS)


def dotted(error: jsonschema.ValidationError) -> str:
    return ".".join(str(part) for part in error.absolute_path)


def errors(schema: Schema, obj: Any) -> list[jsonschema.ValidationError]:
    return sorted(validator_for(schema).iter_errors(obj), key=dotted)


def assert_valid(schema: Schema, obj: Any) -> None:
    found = errors(schema, obj)
    assert not found, "\n".join(f"{dotted(e) or '<root>'}: {e.message}" for e in found)


def apply_defaults(schema: Schema, obj: Any) -> Any:
    """Apply ``default`` keywords to ``obj`` in place, as kube-apiserver does.

    Structural defaulting walks the object top-down: a property that is absent and has a
    ``default`` gets a copy of it, and every present (or just defaulted) value is then
    defaulted against its own schema, so ``default: {}`` on an object pulls in the
    defaults of its fields. Array items and ``additionalProperties`` values are
    defaulted too. Absent objects without a ``default`` stay absent.
    """
    if isinstance(obj, dict):
        properties: dict[str, Schema] = schema.get("properties", {})
        for name, sub in properties.items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                apply_defaults(sub, obj[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, value in obj.items():
                if name not in properties:
                    apply_defaults(extra, value)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            apply_defaults(schema["items"], item)
    return obj


def walk(node: Schema, path: str = "") -> Iterator[tuple[str, Schema]]:
    """Every schema node below ``node`` with its dotted path (``[]`` for array items)."""
    for name, sub in node.get("properties", {}).items():
        here = f"{path}.{name}" if path else name
        yield here, sub
        yield from walk(sub, here)
    for key, suffix in (("items", "[]"), ("additionalProperties", "{}")):
        sub = node.get(key)
        if isinstance(sub, dict):
            yield path + suffix, sub
            yield from walk(sub, path + suffix)


def node_at(schema: Schema, json_path: str) -> Schema:
    """The schema node a printer-column JSONPath such as ``.spec.task.agents`` points at."""
    node = schema
    # ``conditions[?(@.type=="Ready")]``: a list's filter, so an item of that list.
    for part in re.sub(r"\[[^]]*\]", "[]", json_path).strip(".").split("."):
        part, _, listed = part.partition("[")
        assert part in node.get("properties", {}), f"{json_path}: no field {part!r}"
        node = node["properties"][part]
        if listed:
            assert node["type"] == "array", f"{json_path}: {part} is not a list"
            node = node["items"]
    return node


def with_value(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``obj`` with ``value`` set at the dotted ``path``."""
    out = copy.deepcopy(obj)
    *parents, leaf = path.split(".")
    node = out
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return load_yaml(CRD_PATH)


@pytest.fixture(scope="module")
def schema(crd: dict[str, Any]) -> Schema:
    return openapi_schema(crd, "v1alpha1")


@pytest.fixture(scope="module")
def sandbox_crd() -> dict[str, Any]:
    return load_yaml(SANDBOX_CRD_PATH)


def task(spec: dict[str, Any], name: str = "t") -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "CalibanTask",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


VALID = task(
    {
        "task": {"agents": 3, "provider": "scripted", "model": "turns=20,turn_ms=500"},
        "lifecycle": {"idleTimeout": "5m", "onDelete": "checkpoint"},
    }
)


# --- the CRD's shape -----------------------------------------------------------------


def test_names_scope_and_single_served_storage_version(crd: dict[str, Any]) -> None:
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == f"calibantasks.{GROUP}"
    spec = crd["spec"]
    assert spec["group"] == GROUP
    assert spec["scope"] == "Namespaced"
    names = spec["names"]
    assert names["kind"] == "CalibanTask"
    assert names["plural"] == "calibantasks"
    assert names["singular"] == "calibantask"
    assert "ctask" in names["shortNames"]
    assert "caliban" in names["categories"]
    assert [(v["name"], v["served"], v["storage"]) for v in spec["versions"]] == [
        ("v1alpha1", True, True)
    ]


def test_status_subresource_is_enabled(crd: dict[str, Any]) -> None:
    assert crd_version(crd, "v1alpha1")["subresources"]["status"] == {}


def test_printer_columns_point_at_real_fields(crd: dict[str, Any], schema: Schema) -> None:
    columns = {c["name"]: c for c in crd_version(crd, "v1alpha1")["additionalPrinterColumns"]}
    assert {"Phase", "Checkpoint", "Age"} <= set(columns)
    assert list(columns) == ["Phase", "Ready", "Agents", "Wanted", "Checkpoint", "Idle-Since",
                             "Age"]  # fmt: skip
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    # AGENTS is what runs (a restore of 3 agents shows 3), not what a fresh start asks for.
    assert columns["Agents"]["jsonPath"] == ".status.agents"
    assert columns["Wanted"]["jsonPath"] == ".spec.task.agents"
    assert columns["Phase"]["jsonPath"] == ".status.phase"
    assert columns["Checkpoint"]["jsonPath"] == ".status.checkpointRef"
    assert columns["Age"]["jsonPath"] == ".metadata.creationTimestamp"
    assert columns["Age"]["type"] == "date"
    assert columns["Wanted"]["priority"] == 1
    assert "priority" not in columns["Agents"]
    assert columns["Idle-Since"]["priority"] == 1
    for column in columns.values():
        assert column.get("description"), column["name"]
        if column["jsonPath"].startswith(".metadata."):
            continue
        field = node_at(schema, column["jsonPath"])
        if column["type"] == "date":
            assert (field["type"], field.get("format")) == ("string", "date-time")
        else:
            assert field["type"] == column["type"], column["name"]


@pytest.mark.parametrize("path", [CRD_PATH, SANDBOX_CRD_PATH], ids=lambda p: p.name)
def test_crd_schemas_are_structural(path: Path) -> None:
    """Every node has a type (bar preserve-unknown-fields nodes), and map lists key on
    required fields: the API server refuses a CRD that breaks either rule."""
    crd = load_yaml(path)
    for version in crd["spec"]["versions"]:
        root = version["schema"]["openAPIV3Schema"]
        assert root["type"] == "object"
        # Anything more (even a description) and the API server refuses the CRD with
        # "must not specify anything other than name and generateName".
        assert root["properties"]["metadata"] == {"type": "object"}
        for where, node in walk(root):
            opaque = node.get("x-kubernetes-preserve-unknown-fields") is True
            if not (opaque or node.get("x-kubernetes-int-or-string")):
                assert "type" in node, f"{version['name']} {where}: no type"
            if opaque:
                assert node.get("type") == "object", f"{where}: opaque nodes are objects here"
            if node.get("x-kubernetes-list-type") == "map":
                # A map key must be required or defaulted (a container port's protocol).
                items = node["items"]
                required = set(items.get("required", [])) | {
                    key for key, sub in items.get("properties", {}).items() if "default" in sub
                }
                assert set(node["x-kubernetes-list-map-keys"]) <= required, where
            assert not ("properties" in node and "additionalProperties" in node), where


def test_every_calibantask_field_is_described(schema: Schema) -> None:
    assert schema.get("description")
    undescribed = [
        where
        for where, node in walk(schema)
        if not node.get("description") and where != "metadata"  # metadata may not have one
    ]
    assert undescribed == []


def test_every_default_is_valid_for_its_own_field(schema: Schema) -> None:
    """The API server rejects a CRD whose defaults (after nested defaulting) fail validation."""
    defaulted = [(where, node) for where, node in walk(schema) if "default" in node]
    assert {where for where, _ in defaulted} >= {
        "spec.task.agents",
        "spec.lifecycle",
        "spec.lifecycle.onDelete",
        "spec.lifecycle.drainGracePeriod",
        "spec.lifecycle.drainTimeout",
        "spec.lifecycle.suspend",
        "spec.sandbox",
    }
    # Unset means "what the cluster serves", which only the operator can tell; spec.task is
    # required (as caliban-operator requires it), so it has no default to hide its absence.
    assert "spec.sandbox.apiVersion" not in {where for where, _ in defaulted}
    assert "spec.task" not in {where for where, _ in defaulted}
    for where, node in defaulted:
        value = apply_defaults(node, copy.deepcopy(node["default"]))
        assert not errors(node, value), where


def test_status_phases_and_conditions(schema: Schema) -> None:
    status = schema["properties"]["status"]
    assert status["properties"]["phase"]["enum"] == PHASES
    conditions = status["properties"]["conditions"]
    # An atomic list of any strings, as caliban-operator's: its status must stay valid
    # (tests/unit/test_upstream_compat.py).
    assert "x-kubernetes-list-type" not in conditions
    condition = conditions["items"]["properties"]
    assert set(condition) == {
        "type",
        "status",
        "reason",
        "message",
        "lastTransitionTime",
        "observedGeneration",
    }
    assert all(set(condition[f]) == {"type", "description"} for f in ("type", "status", "reason"))
    last_op = status["properties"]["lastOperation"]["properties"]
    assert set(last_op) == {"id", "kind", "state", "error", "startedAt", "finishedAt"}


def test_a_full_status_validates(schema: Schema) -> None:
    obj = dict(
        VALID,
        status={
            "phase": "Suspended",
            "checkpointRef": "ckpt-0123456789abcdef0123",
            "idleSince": "2026-09-13T10:00:00Z",
            "observedGeneration": 4,
            "message": "paused after 5m idle",
            "sandboxName": "t",
            "pvcName": "t-workspace",
            "agents": 0,
            "lastOperation": {
                "id": "op-1",
                "kind": "pause",
                "state": "recorded",
                "startedAt": "2026-09-13T10:05:00Z",
                "finishedAt": "2026-09-13T10:05:07.250+00:00",
            },
            "conditions": [
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": "Suspended",
                    "message": "idle",
                    "lastTransitionTime": "2026-09-13T10:05:07Z",
                    "observedGeneration": 4,
                }
            ],
        },
    )
    assert_valid(schema, obj)


def test_a_completed_status_validates(schema: Schema) -> None:
    obj = dict(
        VALID,
        status={
            "phase": "Completed",
            "checkpointRef": "ckpt-0123456789abcdef0123",
            "completions": 2,
            "lastSuspend": False,
            "lastWake": None,
            "agents": 0,
            "lastOperation": {"id": "op-2", "kind": "complete", "state": "recorded"},
            "conditions": [
                {"type": "Completed", "status": "True", "reason": "AgentsDone", "message": "m"}
            ],
        },
    )
    assert_valid(schema, obj)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("status.phase", "Paused"),
        ("status.completions", -1),
        ("status.lastSuspend", "yes"),
        ("status.idleSince", "yesterday"),
        ("status.conditions", [{"type": "Ready", "status": 1}]),
        ("status.conditions", [{"type": "Ready"}]),
        ("status.lastOperation", {"startedAt": "soon"}),
    ],
)
def test_malformed_status_is_rejected(schema: Schema, path: str, value: Any) -> None:
    found = errors(schema, with_value(VALID, path, value))
    assert found
    assert all(dotted(e).startswith(path) for e in found), [dotted(e) for e in found]


# --- caliban-operator compatibility (the schema is a superset of its CRD) -------------

CALIBAN_OPERATOR_TASK = {
    "apiVersion": API_VERSION,
    "kind": "CalibanTask",
    "metadata": {"name": "refactor-auth", "namespace": "team-a"},
    "spec": {
        "workspaceRef": {"name": "team-a-ws"},
        "providerRef": "planner",
        "task": {
            "prompt": "refactor the auth module",
            "agentType": "general-purpose",
            "interactive": False,
        },
        "model": {"routerConfigRef": "caliban-router"},
        "state": {
            "gonzaloEndpoint": "http://gonzalod.storage.svc:8080",
            "mode": "remote",
            "tokenRef": {"secretName": "gonzalo-agent-token", "key": "token"},
        },
        "isolation": {"runtimeClass": "gvisor", "worktrees": "per-source"},
        "resources": {"class": "standard"},
        "lifecycle": {"idleTimeout": "30m", "onDelete": "checkpoint"},
        "tools": ["read", "edit"],
    },
    "status": {
        "phase": "Running",
        "calibandEndpoint": "refactor-auth.team-a.svc:7070",
        "sandboxRef": {"name": "refactor-auth"},
        "checkpointRef": "ckpt-1",
        "conditions": [{"type": "Ready", "status": "True", "reason": "SandboxReady"}],
        "resolvedWorkspace": {"provider": {"kind": "anthropic", "name": "planner"}},
    },
}


def test_a_caliban_operator_task_still_validates(schema: Schema) -> None:
    obj = copy.deepcopy(CALIBAN_OPERATOR_TASK)
    assert_valid(schema, obj)
    assert_valid(schema, apply_defaults(schema, obj))


# --- samples -------------------------------------------------------------------------

SAMPLE_FACTS: dict[str, dict[str, Any]] = {
    "calibantask-basic.yaml": {
        "spec.task.agents": 3,
        "spec.task.provider": "scripted",
        "spec.task.model": "turns=20,turn_ms=500",
        "spec.lifecycle.onDelete": "checkpoint",
        "spec.lifecycle.idleTimeout": "5m",
    },
    "calibantask-idle-pause.yaml": {"spec.lifecycle.idleTimeout": "30s"},
    "calibantask-restore.yaml": {
        "spec.resumeFrom.checkpointRef": "ckpt-0123456789abcdef0123",
    },
    "calibantask-delete-only.yaml": {"spec.lifecycle.onDelete": "delete"},
    "calibantask-suspended.yaml": {"spec.lifecycle.suspend": True},
}


def lookup(obj: dict[str, Any], path: str) -> Any:
    node: Any = obj
    for part in path.split("."):
        node = node[part]
    return node


def test_the_sample_set_is_complete() -> None:
    assert sorted(p.name for p in SAMPLES) == sorted(SAMPLE_FACTS)


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_sample_validates_and_shows_what_it_says(schema: Schema, path: Path) -> None:
    first_line = path.read_text().splitlines()[0]
    assert first_line.startswith("# "), f"{path.name}: first line should say what it shows"
    obj = load_yaml(path)
    assert obj["apiVersion"] == API_VERSION
    assert obj["kind"] == "CalibanTask"
    assert obj["metadata"]["namespace"] == "default"
    assert_valid(schema, obj)
    defaulted = apply_defaults(schema, copy.deepcopy(obj))
    assert_valid(schema, defaulted)
    for field, expected in SAMPLE_FACTS[path.name].items():
        assert lookup(defaulted, field) == expected, field


# --- malformed specs -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "value"),
    [
        pytest.param("spec.lifecycle.drainGracePeriod", "soon", id="drainGracePeriod-soon"),
        pytest.param("spec.lifecycle.drainTimeout", "2 minutes", id="drainTimeout-words"),
        pytest.param("spec.lifecycle.suspend", "yes", id="suspend-string"),
        pytest.param("spec.task.agents", -1, id="agents-negative"),
        pytest.param("spec.task.agents", 0, id="agents-zero"),
        pytest.param("spec.task.agents", 65, id="agents-too-many"),
        pytest.param("spec.task.agents", "three", id="agents-string"),
        pytest.param("spec.task.agents", 1.5, id="agents-fraction"),
        pytest.param("spec.task.provider", "Not A Provider", id="provider-spaces"),
        pytest.param("spec.task.model", "m" * 257, id="model-too-long"),
        pytest.param("spec.resumeFrom.checkpointRef", "Not_A_Ref!", id="checkpointRef-syntax"),
        pytest.param("spec.resumeFrom.checkpointRef", "c" * 64, id="checkpointRef-too-long"),
        pytest.param("spec.sandbox.apiVersion", "v9", id="sandbox-apiVersion-v9"),
        pytest.param("spec.sandbox.name", "Has_Caps", id="sandbox-name"),
        pytest.param("spec.workspace.storage", "lots", id="workspace-storage"),
    ],
)
def test_malformed_field_is_rejected_and_named(schema: Schema, path: str, value: Any) -> None:
    found = errors(schema, with_value(VALID, path, value))
    assert found, f"{path}={value!r} was accepted"
    assert {dotted(e) for e in found} == {path}, [f"{dotted(e)}: {e.message}" for e in found]


@pytest.mark.parametrize(
    ("obj", "parent", "field"),
    [
        pytest.param(
            with_value(VALID, "spec.resumeFrom", {}),
            "spec.resumeFrom",
            "checkpointRef",
            id="resumeFrom-without-ref",
        ),
        pytest.param(
            with_value(VALID, "spec.lifecycle.idletimeout", "5m"),
            "spec.lifecycle",
            "idletimeout",
            id="misspelt-field",
        ),
        pytest.param(
            with_value(VALID, "spec.task.env", [{"value": "x"}]),
            "spec.task.env.0",
            "name",
            id="env-without-name",
        ),
        pytest.param({k: v for k, v in VALID.items() if k != "spec"}, "", "spec", id="no-spec"),
    ],
)
def test_missing_or_unknown_field_is_named(
    schema: Schema, obj: dict[str, Any], parent: str, field: str
) -> None:
    found = errors(schema, obj)
    assert found
    assert all(dotted(e) == parent and repr(field) in e.message for e in found), [
        f"{dotted(e)}: {e.message}" for e in found
    ]


@pytest.mark.parametrize("duration", ["30s", "5m", "1h30m", "1.5h", "250ms", "2h45m30s"])
def test_go_durations_are_accepted(schema: Schema, duration: str) -> None:
    for field in ("idleTimeout", "drainGracePeriod", "drainTimeout"):
        assert_valid(schema, with_value(VALID, f"spec.lifecycle.{field}", duration))


@pytest.mark.parametrize("duration", ["", "5", "-5m", "5 m", "1d", "m5", "5M", "banana"])
def test_non_durations_are_rejected(schema: Schema, duration: str) -> None:
    """Our own duration fields; idleTimeout takes any string, as caliban-operator's
    does, and the operator refuses one it cannot read (test_upstream_compat)."""
    for path in ("spec.lifecycle.drainGracePeriod", "spec.lifecycle.drainTimeout"):
        assert {dotted(e) for e in errors(schema, with_value(VALID, path, duration))} == {path}
    assert_valid(schema, with_value(VALID, "spec.lifecycle.idleTimeout", duration))


@pytest.mark.parametrize("ref", ["ckpt-0123456789abcdef0123", "a", "0", "x" * 63])
def test_label_value_checkpoint_refs_are_accepted(schema: Schema, ref: str) -> None:
    assert_valid(schema, with_value(VALID, "spec.resumeFrom.checkpointRef", ref))


# --- defaults ------------------------------------------------------------------------


def test_a_spec_of_an_empty_task_gets_every_default(schema: Schema) -> None:
    # spec.task is required, as caliban-operator requires it: its fields are defaulted.
    obj = apply_defaults(schema, task({"task": {}}))
    assert obj["spec"] == {
        "task": {"agents": 1, "provider": "scripted"},
        "lifecycle": {
            "onDelete": "checkpoint",
            "drainGracePeriod": "30s",
            "drainTimeout": "2m",
            "suspend": False,
        },
        # No Sandbox apiVersion: unset, the operator picks what the cluster serves.
        "sandbox": {},
        "workspace": {"storage": "1Gi"},
    }
    assert_valid(schema, obj)


def test_defaults_never_override_what_is_set(schema: Schema) -> None:
    obj = task(
        {
            "task": {"agents": 5, "provider": "anthropic"},
            "lifecycle": {"onDelete": "delete", "drainGracePeriod": "5s", "suspend": True},
            "sandbox": {"apiVersion": "agents.x-k8s.io/v1beta1"},
        }
    )
    spec = apply_defaults(schema, obj)["spec"]
    assert spec["task"] == {"agents": 5, "provider": "anthropic"}
    assert spec["lifecycle"] == {
        "onDelete": "delete",
        "drainGracePeriod": "5s",
        "drainTimeout": "2m",
        "suspend": True,
    }
    assert spec["sandbox"] == {"apiVersion": "agents.x-k8s.io/v1beta1"}


def test_defaults_do_not_invent_optional_objects(schema: Schema) -> None:
    spec = apply_defaults(schema, task({}))["spec"]
    assert "resumeFrom" not in spec
    assert "idleTimeout" not in spec["lifecycle"]
    assert "status" not in apply_defaults(schema, task({}))


def test_status_phase_defaults_to_pending(schema: Schema) -> None:
    assert apply_defaults(schema, dict(task({}), status={}))["status"]["phase"] == "Pending"


# --- agent-sandbox's Sandbox CRD ------------------------------------------------------


def test_the_packaged_sandbox_crd_is_agent_sandboxs_own_byte_for_byte() -> None:
    assert SANDBOX_CRD_PATH.read_bytes() == UPSTREAM_SANDBOX_CRD_PATH.read_bytes()
    here = SANDBOX_CRD_PATH.parent
    assert (here / "LICENSE").read_bytes() == (
        UPSTREAM_SANDBOX_CRD_PATH.parents[2] / "LICENSE"
    ).read_bytes()
    readme = (here / "README.md").read_text()
    assert "v0.5.6" in readme and "211b7579cabed9460c1a692eb687084ff4c5879d" in readme
    assert "Apache License 2.0" in readme


def test_sandbox_crd_stores_v1beta1_and_serves_v1alpha1_deprecated_through_a_webhook(
    sandbox_crd: dict[str, Any],
) -> None:
    spec = sandbox_crd["spec"]
    assert sandbox_crd["metadata"]["name"] == "sandboxes.agents.x-k8s.io"
    assert (spec["group"], spec["scope"]) == ("agents.x-k8s.io", "Namespaced")
    assert (spec["names"]["kind"], spec["names"]["plural"]) == ("Sandbox", "sandboxes")
    versions = {v["name"]: v for v in spec["versions"]}
    assert set(versions) == {"v1alpha1", "v1beta1"}
    assert all(v["served"] for v in versions.values())
    assert [name for name, v in versions.items() if v["storage"]] == ["v1beta1"]
    assert versions["v1alpha1"]["deprecated"] is True
    assert "deprecated" not in versions["v1beta1"]
    assert all(v["subresources"]["status"] == {} for v in versions.values())
    assert spec["conversion"]["strategy"] == "Webhook"


def test_sandbox_versions_suspend_differently(sandbox_crd: dict[str, Any]) -> None:
    alpha = openapi_schema(sandbox_crd, "v1alpha1")["properties"]["spec"]["properties"]
    beta = openapi_schema(sandbox_crd, "v1beta1")["properties"]["spec"]["properties"]
    assert (alpha["replicas"]["minimum"], alpha["replicas"]["maximum"]) == (0, 1)
    assert "operatingMode" not in alpha
    assert beta["operatingMode"]["enum"] == ["Running", "Suspended"]
    assert "replicas" not in beta
    for spec in (alpha, beta):
        # Typed, not opaque: the API server prunes what a PodSpec does not declare.
        assert "containers" in spec["podTemplate"]["properties"]["spec"]["properties"]
        assert set(spec["podTemplate"]["properties"]["metadata"]["properties"]) == {
            "annotations",
            "labels",
        }


def sandbox(version: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"agents.x-k8s.io/{version}",
        "kind": "Sandbox",
        "metadata": {"name": "t", "namespace": "default"},
        "spec": spec,
    }


POD_TEMPLATE = {"spec": {"containers": [{"name": "caliband", "image": "caliband:dev"}]}}
PVC_TEMPLATE = {
    "metadata": {"name": "workspace"},
    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
}


@pytest.mark.parametrize(
    ("version", "suspend", "valid"),
    [
        ("v1alpha1", {"replicas": 0}, True),
        ("v1alpha1", {"replicas": 1}, True),
        ("v1alpha1", {"replicas": 2}, False),
        ("v1alpha1", {"operatingMode": "Suspended"}, False),
        ("v1beta1", {"operatingMode": "Suspended"}, True),
        ("v1beta1", {"operatingMode": "Running"}, True),
        ("v1beta1", {"operatingMode": "Paused"}, False),
        ("v1beta1", {"replicas": 0}, False),
    ],
)
def test_sandbox_objects_the_operator_writes(
    sandbox_crd: dict[str, Any], version: str, suspend: dict[str, Any], valid: bool
) -> None:
    schema = openapi_schema(sandbox_crd, version)
    obj = sandbox(
        version, {"podTemplate": POD_TEMPLATE, "volumeClaimTemplates": [PVC_TEMPLATE], **suspend}
    )
    found = errors(schema, obj)
    assert (not found) is valid, [f"{dotted(e)}: {e.message}" for e in found]


def test_sandbox_defaults_to_running(sandbox_crd: dict[str, Any]) -> None:
    alpha = apply_defaults(
        openapi_schema(sandbox_crd, "v1alpha1"), sandbox("v1alpha1", {"podTemplate": {}})
    )
    beta = apply_defaults(
        openapi_schema(sandbox_crd, "v1beta1"), sandbox("v1beta1", {"podTemplate": {}})
    )
    assert alpha["spec"]["replicas"] == 1
    assert beta["spec"]["operatingMode"] == "Running"


# --- the real kubectl ----------------------------------------------------------------

KUBECTL = shutil.which("kubectl")
CHECK_LABEL = f"{GROUP}/manifest-check"


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")
@pytest.mark.parametrize(
    "path", [*SAMPLES, CRD_PATH, SANDBOX_CRD_PATH], ids=lambda p: p.parent.name + "/" + p.name
)
def test_kubectl_reads_the_manifest_as_written(path: Path) -> None:
    """kubectl parses the file as one Kubernetes object, and reads it exactly as PyYAML
    does (so no YAML 1.1 surprises such as an unquoted ``True`` turning into a bool)."""
    assert KUBECTL is not None
    result = subprocess.run(
        [
            KUBECTL,
            "label",
            "--local",
            "--dry-run=client",
            "--output=json",
            "--filename",
            str(path),
            f"{CHECK_LABEL}=ok",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["metadata"].pop("labels") == {CHECK_LABEL: "ok"}
    assert printed == load_yaml(path)
