"""CRD validation rules (``x-kubernetes-validations``) in the embedded API's store, as a
real API server applies them: evaluated with cel-python on create and update, transition
rules (``oldSelf``) on updates only and where the old object has a value, list items
correlated by their map keys, failures worded as the server words them, and a CRD whose
rule cannot be evaluated refused. Driven through :class:`ClusterState` with a real
resource registry, so the create, replace, patch and status paths are the ones the HTTP
layer calls."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml

from orchestrator.devcluster import cel, patching, resources
from orchestrator.devcluster.resources import ResourceRegistry, ServedResource
from orchestrator.devcluster.store import ClusterState, Writer

REPO = Path(__file__).resolve().parents[2]
GROUP = "example.caliban-ai.dev"
NS = "default"


def crd(spec_schema: dict[str, Any], *, status: bool = True) -> dict[str, Any]:
    """A namespaced Widget CRD whose ``spec`` has ``spec_schema``."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {"kind": "Widget", "plural": "widgets"},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}} if status else {},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": spec_schema,
                                "status": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                },
                            },
                        }
                    },
                }
            ],
        },
    }


def widget(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": spec,
    }


class Api:
    """A store with the built-ins, the way the emulator builds it."""

    def __init__(self) -> None:
        self.registry = ResourceRegistry()
        self.state = ClusterState(kmock.ObjectsArray(), self.registry)
        namespaces = self.registry.lookup(*resources.NAMESPACES)
        assert namespaces is not None
        self.state.create(namespaces, None, _namespace(NS))

    @property
    def crds(self) -> ServedResource:
        served = self.registry.lookup(*resources.CRDS)
        assert served is not None
        return served

    def serve(self, definition: dict[str, Any]) -> ServedResource:
        self.state.create(self.crds, None, definition)
        served = self.registry.lookup(GROUP, "v1", "widgets")
        assert served is not None
        return served

    def refused_crd(self, definition: dict[str, Any]) -> Refusal:
        return refused(self.state.create, self.crds, None, definition)


def _namespace(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


@dataclass(frozen=True)
class Refusal:
    """A 422 Invalid: its message and its causes."""

    message: str
    causes: list[dict[str, str]]


def refused(call: Any, *args: Any, **kwargs: Any) -> Refusal:
    with pytest.raises(kmock.KubernetesError) as caught:
        call(*args, **kwargs)
    error = caught.value
    assert (error.status, error.reason) == (422, "Invalid")
    assert isinstance(error.message, str) and isinstance(error.details, dict)
    return Refusal(error.message, list(error.details["causes"]))


@pytest.fixture
def api() -> Api:
    return Api()


IMMUTABLE_NAME: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {
            "type": "string",
            "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "is immutable"}],
        },
        "size": {"type": "integer"},
    },
}


# ---------------------------------------------------------------------------- create


def test_a_rule_that_holds_admits_the_object_and_one_that_fails_refuses_it_by_field(
    api: Api,
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "sandbox": {
                "type": "object",
                "properties": {
                    "name": {
                        "type": "string",
                        "x-kubernetes-validations": [
                            {"rule": "self.startsWith('sbx-')", "message": "must start with sbx-"}
                        ],
                    }
                },
            }
        },
    }
    widgets = api.serve(crd(schema))
    api.state.create(widgets, NS, widget("w1", {"sandbox": {"name": "sbx-1"}}))
    error = refused(api.state.create, widgets, NS, widget("t1", {"sandbox": {"name": "other"}}))
    assert error.message == (
        f'Widget.{GROUP} "t1" is invalid: spec.sandbox.name: Invalid value: "string": '
        "must start with sbx-"
    )
    assert error.causes == [
        {
            "reason": "FieldValueInvalid",
            "message": 'Invalid value: "string": must start with sbx-',
            "field": "spec.sandbox.name",
        }
    ]


def test_without_a_message_the_failure_names_the_rule(api: Api) -> None:
    schema = {
        "type": "object",
        "x-kubernetes-validations": [{"rule": "  self.replicas <= self.limit "}],
        "properties": {"replicas": {"type": "integer"}, "limit": {"type": "integer"}},
    }
    widgets = api.serve(crd(schema))
    error = refused(api.state.create, widgets, NS, widget("w", {"replicas": 3, "limit": 2}))
    assert error.message.endswith(
        'spec: Invalid value: "object": failed rule: self.replicas <= self.limit'
    )


def test_rules_see_defaults_and_integers_as_int64(api: Api) -> None:
    schema = {
        "type": "object",
        "x-kubernetes-validations": [
            {"rule": "self.replicas + 1 == 2 && type(self.replicas) == int", "message": "one"}
        ],
        "properties": {"replicas": {"type": "integer", "default": 1}},
    }
    widgets = api.serve(crd(schema))
    created, _ = api.state.create(widgets, NS, widget("w", {}))
    assert created["spec"] == {"replicas": 1}
    error = refused(api.state.create, widgets, NS, widget("big", {"replicas": 9223372036854775807}))
    assert "evaluating rule: self.replicas + 1 == 2" in error.message


def test_an_evaluation_error_fails_the_rule_with_the_error_in_the_message(api: Api) -> None:
    schema = {
        "type": "object",
        "x-kubernetes-validations": [{"rule": "self.task.prompt != ''", "message": "no prompt"}],
        "properties": {
            "task": {"type": "object", "properties": {"prompt": {"type": "string"}}},
        },
    }
    widgets = api.serve(crd(schema))
    api.state.create(widgets, NS, widget("ok", {"task": {"prompt": "go"}}))
    error = refused(api.state.create, widgets, NS, widget("w", {"task": {}}))
    (cause,) = error.causes
    assert cause["field"] == "spec"
    assert cause["message"].startswith('Invalid value: "object": ')
    assert "'prompt'" in cause["message"]
    assert cause["message"].endswith("evaluating rule: self.task.prompt != ''")


def test_a_root_rule_sees_the_name_and_fails_at_the_root(api: Api) -> None:
    definition = crd({"type": "object"})
    root = definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    root["x-kubernetes-validations"] = [
        {"rule": "self.metadata.name.startsWith('w-')", "message": "name must start with w-"}
    ]
    widgets = api.serve(definition)
    api.state.create(widgets, NS, widget("w-1", {}))
    error = refused(api.state.create, widgets, NS, widget("x", {}))
    assert error.message.endswith(
        '"x" is invalid: <nil>: Invalid value: "object": name must start with w-'
    )


def test_reserved_property_names_are_escaped_as_cel_go_escapes_them(api: Api) -> None:
    schema = {
        "type": "object",
        "x-kubernetes-validations": [
            {"rule": "has(self.__namespace__) && self.dry__dash__run", "message": "both"}
        ],
        "properties": {"namespace": {"type": "string"}, "dry-run": {"type": "boolean"}},
    }
    widgets = api.serve(crd(schema))
    api.state.create(widgets, NS, widget("w", {"namespace": "a", "dry-run": True}))
    refused(api.state.create, widgets, NS, widget("v", {"dry-run": True}))


def test_a_type_error_leaves_the_rules_unchecked_with_the_servers_notice(api: Api) -> None:
    schema = {
        "type": "object",
        "x-kubernetes-validations": [{"rule": "self.size > 0"}],
        "properties": {"size": {"type": "integer"}},
    }
    widgets = api.serve(crd(schema))
    error = refused(api.state.create, widgets, NS, widget("w", {"size": "big"}))
    assert [c["field"] for c in error.causes] == ["spec.size", "<nil>"]
    assert "some validation rules were not checked because the object was invalid" in (
        error.message
    )


# ---------------------------------------------------------------------------- reasons


def test_reason_and_field_path_shape_the_cause(api: Api) -> None:
    schema = {
        "type": "object",
        "x-kubernetes-validations": [
            {
                "rule": "!has(self.mode) || self.mode != 'root'",
                "message": "root is not allowed",
                "reason": "FieldValueForbidden",
                "fieldPath": ".mode",
            },
            {
                "rule": "self.mode != 'tls' || has(self.cert)",
                "message": "a cert is needed for tls",
                "reason": "FieldValueRequired",
                "fieldPath": ".cert",
            },
            {
                "rule": "!has(self.labels) || !('x' in self.labels)",
                "reason": "FieldValueDuplicate",
                "fieldPath": "['labels']['x']",
            },
        ],
        "properties": {
            "mode": {"type": "string"},
            "cert": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }
    widgets = api.serve(crd(schema))
    error = refused(api.state.create, widgets, NS, widget("w", {"mode": "root"}))
    assert error.causes == [
        {
            "reason": "FieldValueForbidden",
            "message": "Forbidden: root is not allowed",
            "field": "spec.mode",
        }
    ]
    error = refused(api.state.create, widgets, NS, widget("t", {"mode": "tls"}))
    assert error.message.endswith("spec.cert: Required value: a cert is needed for tls")
    error = refused(api.state.create, widgets, NS, widget("d", {"mode": "a", "labels": {"x": "1"}}))
    assert error.causes == [
        {
            "reason": "FieldValueDuplicate",
            "message": 'Duplicate value: "object"',
            "field": "spec.labels[x]",
        }
    ]


def test_a_message_expression_gives_the_message_and_falls_back_to_the_message(
    api: Api,
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "replicas": {
                "type": "integer",
                "x-kubernetes-validations": [
                    {
                        "rule": "self <= 5",
                        "message": "too many",
                        "messageExpression": "'replicas ' + string(self) + ' is over 5'",
                    }
                ],
            },
            "agents": {
                "type": "integer",
                "x-kubernetes-validations": [
                    {"rule": "self <= 5", "message": "too many", "messageExpression": "self"}
                ],
            },
        },
    }
    widgets = api.serve(crd(schema))
    error = refused(api.state.create, widgets, NS, widget("w", {"replicas": 7}))
    assert error.message.endswith('spec.replicas: Invalid value: "integer": replicas 7 is over 5')
    error = refused(api.state.create, widgets, NS, widget("v", {"agents": 7}))
    assert error.message.endswith('spec.agents: Invalid value: "integer": too many')


# ---------------------------------------------------------------------------- transitions


def test_a_transition_rule_runs_on_updates_only_and_not_on_a_newly_set_field(api: Api) -> None:
    widgets = api.serve(crd(IMMUTABLE_NAME))
    api.state.create(widgets, NS, widget("w", {"name": "a", "size": 1}))
    api.state.create(widgets, NS, widget("unnamed", {"size": 1}))
    changed = copy.deepcopy(api.state.get(widgets, NS, "w"))
    changed["spec"]["name"] = "b"
    error = refused(api.state.replace, widgets, NS, "w", changed)
    assert error.message == (
        f'Widget.{GROUP} "w" is invalid: spec.name: Invalid value: "string": is immutable'
    )
    resized = {**api.state.get(widgets, NS, "w"), "spec": {"name": "a", "size": 2}}
    replaced, _ = api.state.replace(widgets, NS, "w", resized)
    assert replaced["spec"] == {"name": "a", "size": 2}
    named, _, _ = api.state.patch(
        widgets, NS, "unnamed", patching.MERGE_PATCH, {"spec": {"name": "late"}}
    )
    assert named["spec"]["name"] == "late"


@pytest.mark.parametrize(
    ("content_type", "patch"),
    [
        (patching.MERGE_PATCH, {"spec": {"name": "b"}}),
        (patching.JSON_PATCH, [{"op": "replace", "path": "/spec/name", "value": "b"}]),
        (patching.STRATEGIC_MERGE_PATCH, {"spec": {"name": "b"}}),
        (
            patching.APPLY_PATCH,
            {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "spec": {"name": "b"}},
        ),
    ],
    ids=["merge", "json", "strategic", "apply"],
)
def test_every_patch_type_is_held_to_a_transition_rule(
    api: Api, content_type: str, patch: Any
) -> None:
    widgets = api.serve(crd(IMMUTABLE_NAME))
    api.state.create(widgets, NS, widget("w", {"name": "a", "size": 1}))
    # Forced: an apply of a field another manager set is otherwise a conflict, found
    # before the object is validated.
    writer = Writer("test", force=content_type == patching.APPLY_PATCH)
    error = refused(api.state.patch, widgets, NS, "w", content_type, patch, writer=writer)
    assert "spec.name: Invalid value" in error.message
    assert api.state.get(widgets, NS, "w")["spec"]["name"] == "a"


def test_status_writes_are_held_to_the_objects_rules(api: Api) -> None:
    schema = {
        "type": "object",
        "x-kubernetes-validations": [{"rule": "self.size < 10", "message": "too big"}],
        **{k: v for k, v in IMMUTABLE_NAME.items() if k != "type"},
    }
    widgets = api.serve(crd(schema))
    api.state.create(widgets, NS, widget("w", {"name": "a", "size": 1}))
    updated, _, _ = api.state.patch(
        widgets,
        NS,
        "w",
        patching.MERGE_PATCH,
        {"status": {"phase": "Ready"}},
        subresource="status",
    )
    assert updated["status"] == {"phase": "Ready"}


def test_list_map_items_are_correlated_by_key_and_new_items_are_not_checked(api: Api) -> None:
    schema = {
        "type": "object",
        "properties": {
            "ports": {
                "type": "array",
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["name"],
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string"},
                        "port": {
                            "type": "integer",
                            "x-kubernetes-validations": [
                                {"rule": "self == oldSelf", "message": "port is immutable"}
                            ],
                        },
                    },
                },
            }
        },
    }
    widgets = api.serve(crd(schema))
    ports = [{"name": "http", "port": 80}, {"name": "grpc", "port": 9000}]
    api.state.create(widgets, NS, widget("w", {"ports": ports}))
    reordered = [{"name": "https", "port": 443}, ports[1], ports[0]]
    updated, _, _ = api.state.patch(
        widgets, NS, "w", patching.MERGE_PATCH, {"spec": {"ports": reordered}}
    )
    assert [p["name"] for p in updated["spec"]["ports"]] == ["https", "grpc", "http"]
    changed = [reordered[0], reordered[1], {"name": "http", "port": 8080}]
    error = refused(
        api.state.patch, widgets, NS, "w", patching.MERGE_PATCH, {"spec": {"ports": changed}}
    )
    assert [c["field"] for c in error.causes] == ["spec.ports[2].port"]


def test_map_values_are_correlated_by_key(api: Api) -> None:
    schema = {
        "type": "object",
        "properties": {
            "limits": {
                "type": "object",
                "additionalProperties": {
                    "type": "integer",
                    "x-kubernetes-validations": [{"rule": "self >= oldSelf", "message": "no"}],
                },
            }
        },
    }
    widgets = api.serve(crd(schema))
    api.state.create(widgets, NS, widget("w", {"limits": {"cpu": 2, "mem": 4}}))
    api.state.patch(widgets, NS, "w", patching.MERGE_PATCH, {"spec": {"limits": {"cpu": 3}}})
    error = refused(
        api.state.patch, widgets, NS, "w", patching.MERGE_PATCH, {"spec": {"limits": {"mem": 1}}}
    )
    assert error.message.endswith('spec.limits[mem]: Invalid value: "integer": no')


# ---------------------------------------------------------------------------- refused CRDs


@pytest.mark.parametrize(
    ("rule", "why"),
    [
        ("self.size >", "compilation failed: ERROR: <input>:1:11: Syntax error"),
        ("self.name.lowerAscii() == 'a'", "undeclared reference to 'lowerAscii'"),
        ("slef.size > 0", "undeclared reference to 'slef'"),
    ],
    ids=["syntax", "function-celpy-lacks", "unknown-variable"],
)
def test_a_crd_whose_rule_does_not_compile_is_refused_naming_the_rule(
    api: Api, rule: str, why: str
) -> None:
    schema = {"type": "object", "x-kubernetes-validations": [{"rule": rule}]}
    error = api.refused_crd(crd(schema))
    field = (
        "spec.versions[0].schema.openAPIV3Schema.properties[spec].x-kubernetes-validations[0].rule"
    )
    assert error.message.startswith(
        f'CustomResourceDefinition.apiextensions.k8s.io "widgets.{GROUP}" is invalid: '
        f'{field}: Invalid value: "{rule}": compilation failed: '
    )
    assert why in error.message
    assert api.registry.lookup(GROUP, "v1", "widgets") is None


def test_a_crd_update_with_a_bad_rule_is_refused_and_the_served_crd_stays(api: Api) -> None:
    widgets = api.serve(crd(IMMUTABLE_NAME))
    stored = api.state.get(api.crds, None, f"widgets.{GROUP}")
    broken = copy.deepcopy(stored)
    name = broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    name["properties"]["name"]["x-kubernetes-validations"][0]["rule"] = "self == "
    refused(api.state.replace, api.crds, None, f"widgets.{GROUP}", broken)
    api.state.create(widgets, NS, widget("w", {"name": "a"}))
    refused(api.state.patch, widgets, NS, "w", patching.MERGE_PATCH, {"spec": {"name": "b"}})


def test_a_crd_is_refused_for_rules_it_could_not_evaluate_as_written(api: Api) -> None:
    schema = {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {
                    "type": "string",
                    "x-kubernetes-validations": [{"rule": "self == oldSelf"}],
                },
            },
            "mode": {
                "type": "string",
                "allOf": [{"x-kubernetes-validations": [{"rule": "self != ''"}]}],
            },
            "size": {
                "type": "integer",
                "x-kubernetes-validations": [
                    {"rule": "self > 0", "reason": "FieldValueTooLong"},
                    {"rule": "self > 0", "fieldPath": ".nothing"},
                    {"rule": "self > 0", "messageExpression": "self +"},
                ],
            },
        },
    }
    error = api.refused_crd(crd(schema))
    where = "spec.versions[0].schema.openAPIV3Schema.properties[spec].properties"
    assert [(c["field"], c["reason"]) for c in error.causes] == [
        (f"{where}[tags].items.x-kubernetes-validations[0].rule", "FieldValueInvalid"),
        (f"{where}[mode].allOf[0].x-kubernetes-validations", "FieldValueForbidden"),
        (f"{where}[size].x-kubernetes-validations[0].reason", "FieldValueNotSupported"),
        (f"{where}[size].x-kubernetes-validations[1].fieldPath", "FieldValueInvalid"),
        (f"{where}[size].x-kubernetes-validations[2].messageExpression", "FieldValueInvalid"),
    ]
    assert (
        "oldSelf cannot be used on the uncorrelatable portion of the schema"
        in (error.causes[0]["message"])
    )


def test_the_crds_the_dev_stack_serves_have_rules_that_all_compile() -> None:
    paths = [
        REPO / "orchestrator/operator/crds/calibantask.yaml",
        *sorted((REPO / "orchestrator/devcluster/crds").rglob("*.yaml")),
    ]
    with_rules = 0
    for path in paths:
        for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if isinstance(document, dict) and document.get("kind") == "CustomResourceDefinition":
                assert cel.check_crd(document) == [], path
                with_rules += "x-kubernetes-validations" in path.read_text(encoding="utf-8")
    assert with_rules >= 4


# ---------------------------------------------------------------------------- CalibanTask


def calibantasks(
    api: Api,
) -> tuple[ServedResource, Callable[[str, dict[str, Any]], dict[str, Any]], str]:
    """The CalibanTask CRD served by ``api``: its resource, a maker of tasks, its group."""
    definition = yaml.safe_load(
        (REPO / "orchestrator/operator/crds/calibantask.yaml").read_text(encoding="utf-8")
    )
    api.state.create(api.crds, None, definition)
    group = definition["spec"]["group"]
    version = next(v["name"] for v in definition["spec"]["versions"] if v.get("storage"))
    tasks = api.registry.lookup(group, version, "calibantasks")
    assert tasks is not None

    def task(name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": f"{group}/{version}",
            "kind": "CalibanTask",
            "metadata": {"name": name},
            "spec": spec,
        }

    return tasks, task, group


def test_the_calibantask_crd_refuses_a_workspace_ref_without_a_prompt(api: Api) -> None:
    tasks, task, group = calibantasks(api)
    api.state.create(tasks, NS, task("plain", {"task": {"agents": 1}}))
    api.state.create(
        tasks, NS, task("ws", {"task": {"prompt": "go"}, "workspaceRef": {"name": "repo"}})
    )
    error = refused(
        api.state.create, tasks, NS, task("t1", {"task": {}, "workspaceRef": {"name": "repo"}})
    )
    assert error.message.startswith(
        f'CalibanTask.{group} "t1" is invalid: spec: Invalid value: "object": '
        "spec.task.prompt is required with a workspaceRef"
    )


def test_the_calibantask_crd_refuses_a_name_no_label_can_carry(api: Api) -> None:
    """A task's name is the value of its children's task label (at most 63 characters).
    Tried: 64 characters (refused, one message naming why) and 63 (admitted)."""
    tasks, make, group = calibantasks(api)

    def task(name: str) -> dict[str, Any]:
        return make(name, {"task": {"agents": 1}})

    api.state.create(tasks, NS, task("a" * 63))
    error = refused(api.state.create, tasks, NS, task("b" * 64))
    assert error.message.startswith(f'CalibanTask.{group} "{"b" * 64}" is invalid: ')
    assert "a CalibanTask's name is at most 63 characters" in error.message


def test_what_an_update_leaves_unchanged_is_not_held_to_a_rule_again(api: Api) -> None:
    """Ratcheting, as the API server does it. Tried: a rule added to the CRD after an
    object broke it; the object's other fields and its status still change, and a change
    of the field that breaks it is refused. (Without it every status write of a task
    evaluated every spec rule again: 3.75 ms a status patch against 1.27 ms.)"""
    loose = {"type": "object", "properties": {"name": {"type": "string"},
                                              "size": {"type": "integer"}}}  # fmt: skip
    widgets = api.serve(crd(loose))
    api.state.create(widgets, NS, widget("w", {"name": "a", "size": 5}))
    strict = {**loose, "properties": {
        "name": {"type": "string"},
        "size": {"type": "integer",
                 "x-kubernetes-validations": [{"rule": "self < 3", "message": "too big"}]},
    }}  # fmt: skip
    definition = crd(strict)
    current = api.state.get(api.crds, None, definition["metadata"]["name"])
    definition["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    api.state.replace(api.crds, None, definition["metadata"]["name"], definition)
    served = api.registry.lookup(GROUP, "v1", "widgets")
    assert served is not None
    widgets = served  # served again with the rule

    renamed, _, _ = api.state.patch(widgets, NS, "w", patching.MERGE_PATCH, {"spec": {"name": "b"}})
    assert renamed["spec"] == {"name": "b", "size": 5}
    api.state.patch(widgets, NS, "w", patching.MERGE_PATCH, {"status": {"seen": True}},
                    subresource="status")  # fmt: skip
    error = refused(api.state.patch, widgets, NS, "w", patching.MERGE_PATCH, {"spec": {"size": 4}})
    assert "spec.size: Invalid value" in error.message and "too big" in error.message
    assert api.state.get(widgets, NS, "w")["spec"]["size"] == 5
