"""Every field of caliban-operator's spec is honoured as its controller honours it, or
said not to be: ``isolation.runtimeClass`` (the task's, else its Workspace's) is the
pod's ``runtimeClassName``; ``state.gonzaloEndpoint`` and ``model.routerConfigRef`` are
the daemon container's ``GONZALO_ENDPOINT`` and ``CALIBAN_ROUTER_CONFIG_REF``; the rest
(``agentType``, ``tools``, …) are named by ``unhonoured``. What upstream refuses (an
empty prompt, a workspaceRef without a prompt) is refused."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.operator import crd
from orchestrator.operator.children import PodSettings, TaskRef, sandbox
from orchestrator.operator.lifecycle import SpecError, TaskSpec, parse_spec, unhonoured
from orchestrator.operator.workspace import resolve
from orchestrator.settings import Settings

WORKSPACE: dict[str, Any] = {
    "apiVersion": crd.API_VERSION, "kind": crd.WORKSPACE_KIND, "metadata": {"name": "ws"},
    "spec": {
        "displayName": "ws",
        "isolation": {"runtimeClass": "kata"},
        "sources": [{"name": "app", "repo": "file:///srv/app.git", "path": "/work/app"}],
        "providers": [{"name": "local", "kind": "ollama", "model": "m",
                       "baseUrl": "http://127.0.0.1:11434"}],
        "defaultProvider": "local",
    },
}  # fmt: skip


def pod_of(spec: TaskSpec) -> dict[str, Any]:
    pod = PodSettings.of(Settings(broker_url="redis://127.0.0.1:6379/0"))
    body = sandbox(TaskRef("team-a", "t", "u-1"), spec.with_sandbox_api_version(
        crd.SANDBOX_V1BETA1), "ws-t", pod)  # fmt: skip
    spec_: dict[str, Any] = body["spec"]["podTemplate"]["spec"]
    return spec_


def bound(extra: dict[str, Any]) -> TaskSpec:
    spec = parse_spec({"task": {"prompt": "go"}, "workspaceRef": {"name": "ws"}, **extra})
    return spec.with_binding(resolve(WORKSPACE, "ws", None, ""))


@pytest.mark.parametrize(
    ("extra", "runtime_class"),
    [
        ({}, "kata"),  # the Workspace's default
        ({"isolation": {"runtimeClass": "gvisor"}}, "gvisor"),  # the task's wins
        ({"isolation": {"runtimeClass": None}}, "kata"),  # a null is unset
    ],
)
def test_the_runtime_class_is_the_tasks_else_its_workspaces(
    extra: dict[str, Any], runtime_class: str
) -> None:
    assert pod_of(bound(extra))["runtimeClassName"] == runtime_class


def test_a_task_without_a_workspace_runs_its_own_runtime_class_or_the_default() -> None:
    assert "runtimeClassName" not in pod_of(parse_spec({"task": {}}))
    spec = parse_spec({"task": {}, "isolation": {"runtimeClass": "gvisor"}})
    assert pod_of(spec)["runtimeClassName"] == "gvisor"


def test_gonzalo_and_the_router_config_reach_the_daemon_as_upstream_names_them() -> None:
    spec = bound({"state": {"gonzaloEndpoint": "http://127.0.0.1:7070"},
                  "model": {"routerConfigRef": "caliban-router"}})  # fmt: skip
    env = {e["name"]: e.get("value") for e in pod_of(spec)["containers"][0]["env"]}
    assert env["GONZALO_ENDPOINT"] == "http://127.0.0.1:7070"
    assert env["CALIBAN_ROUTER_CONFIG_REF"] == "caliban-router"
    plain = {e["name"] for e in pod_of(bound({}))["containers"][0]["env"]}
    assert not plain & {"GONZALO_ENDPOINT", "CALIBAN_ROUTER_CONFIG_REF"}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({}, ()),
        ({"isolation": {"runtimeClass": "gvisor"}, "state": {"gonzaloEndpoint": "x"},
          "model": {"routerConfigRef": "r"}}, ()),
        ({"task": {"prompt": "go", "agentType": "planner"}}, ("spec.task.agentType",)),
        ({"tools": ["grep"], "resources": {"class": "large"},
          "isolation": {"worktrees": "per-source"}},
         ("spec.isolation.worktrees", "spec.resources.class", "spec.tools")),
        ({"state": {"mode": "gonzalo", "tokenRef": {"secretName": "s", "key": "k"}}},
         ("spec.state.mode", "spec.state.tokenRef")),
        ({"tools": []}, ()),
    ],
)  # fmt: skip
def test_what_is_not_acted_on_is_named(extra: dict[str, Any], named: tuple[str, ...]) -> None:
    assert unhonoured(parse_spec({"task": {"prompt": "go"}, **extra})) == named


@pytest.mark.parametrize(
    "given",
    [{"task": {"prompt": ""}}, {"task": {}, "workspaceRef": {"name": "ws"}}],
    ids=["empty-prompt", "workspace-without-prompt"],
)
def test_what_upstream_refuses_is_refused_naming_the_prompt(given: dict[str, Any]) -> None:
    with pytest.raises(SpecError) as refused:
        parse_spec(given)
    assert refused.value.field == "task.prompt"
