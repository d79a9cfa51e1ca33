"""caliban-operator's Workspace API resolved for a task (``orchestrator.operator.workspace``):
which provider a task binds, which kinds we refuse and why, what the daemon's pod gets
from the binding, and that no credential value is ever part of it."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from orchestrator.operator import crd
from orchestrator.operator.children import PodSettings, TaskRef, sandbox
from orchestrator.operator.lifecycle import SpecError, parse_spec
from orchestrator.operator.workspace import (
    API_KEY_ENV,
    BASE_URL_ENV,
    Binding,
    WorkspaceProblem,
    pod_parts,
    resolve,
)
from orchestrator.settings import Settings
from tests import upstream

REPO = Path(__file__).resolve().parents[2]

SECRET_NAME = "gateway-key"


def workspace(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "displayName": "Team A",
        "sources": [{"name": "app", "repo": "file:///srv/app.git", "path": "/work/app"}],
        "providers": [
            {"name": "planner", "kind": "anthropic", "model": "claude",
             "credentialsRef": {"secretName": "anthropic-key", "key": "api-key"}},
            {"name": "workers", "kind": "ollama", "baseUrl": "http://127.0.0.1:11434",
             "model": "qwen2.5-coder"},
            {"name": "gateway", "kind": "openai", "baseUrl": "http://127.0.0.1:8080/v1/",
             "model": "gpt-local", "credentialsRef": {"secretName": SECRET_NAME, "key": "k"}},
        ],
        "defaultProvider": "workers",
    }  # fmt: skip
    base.update(spec)
    return {"apiVersion": crd.API_VERSION, "kind": crd.WORKSPACE_KIND,
            "metadata": {"name": "ws"}, "spec": base}  # fmt: skip


@pytest.mark.parametrize(
    ("provider_ref", "spec", "expected"),
    [
        ("gateway", {}, ("gateway", "openai", "gpt-local", "http://127.0.0.1:8080/v1")),
        (None, {}, ("workers", "ollama", "qwen2.5-coder", "http://127.0.0.1:11434/v1")),
        # The sole provider needs no default.
        (None, {"defaultProvider": None, "providers": [
            {"name": "only", "kind": "ollama", "model": "m"}]},
         ("only", "ollama", "m", "http://127.0.0.1:11434/v1")),
        # ollama's /v1 is not doubled; openai-compatible is an openai.
        (None, {"defaultProvider": None, "providers": [
            {"name": "o", "kind": "Ollama", "baseUrl": "http://127.0.0.1:9/v1", "model": "m"}]},
         ("o", "ollama", "m", "http://127.0.0.1:9/v1")),
        (None, {"defaultProvider": None, "providers": [
            {"name": "c", "kind": "openai-compatible", "baseUrl": "http://127.0.0.1:9/api",
             "model": "m"}]},
         ("c", "openai-compatible", "m", "http://127.0.0.1:9/api")),
    ],
)  # fmt: skip
def test_the_task_binds_providerref_else_the_default_else_the_sole_provider(
    provider_ref: str | None, spec: dict[str, Any], expected: tuple[str, str, str, str]
) -> None:
    binding = resolve(workspace(**spec), "ws", provider_ref, "")
    assert (binding.provider, binding.kind, binding.model, binding.base_url) == expected


def test_the_tasks_own_model_wins_over_the_providers() -> None:
    assert resolve(workspace(), "ws", "gateway", "gpt-other").model == "gpt-other"


@pytest.mark.parametrize(
    ("tried", "found", "provider_ref", "reason", "says"),
    [
        ("no Workspace", None, None, "WorkspaceNotFound", "does not exist"),
        ("a provider we cannot drive", workspace(), "planner", "UnsupportedProviderKind",
         "kind anthropic, which caliban-drain cannot drive yet"),
        ("the default is one we cannot drive", workspace(defaultProvider="planner"), None,
         "UnsupportedProviderKind", "pick another provider with spec.providerRef"),
        ("a providerRef the Workspace lacks", workspace(), "nobody", "ProviderNotFound",
         "names provider 'nobody'"),
        ("two providers, no default, no ref", workspace(defaultProvider=None), None,
         "NoDefaultProvider", "set spec.providerRef to one of gateway, planner, workers"),
        ("an openai without baseUrl", workspace(providers=[
            {"name": "x", "kind": "openai", "model": "m"}], defaultProvider=None), None,
         "ProviderNeedsBaseUrl", "configures no remote endpoint"),
        ("no model anywhere", workspace(providers=[{"name": "x", "kind": "ollama"}],
                                        defaultProvider=None), None,
         "InvalidWorkspace", "has no model"),
        ("a source at the workspace mount", workspace(sources=[
            {"name": "a", "repo": "r", "path": "/workspace/a"}]), None,
         "InvalidWorkspace", "overlaps /workspace"),
        ("a relative source path", workspace(sources=[{"name": "a", "repo": "r", "path": "a"}]),
         None, "InvalidWorkspace", "not an absolute path"),
        ("a source name that is no DNS label", workspace(sources=[
            {"name": "../x", "repo": "r", "path": "/x"}]), None,
         "InvalidWorkspace", "is not a DNS label"),
        ("two sources at one path", workspace(sources=[
            {"name": "a", "repo": "r", "path": "/x"}, {"name": "b", "repo": "r", "path": "/x"}]),
         None, "InvalidWorkspace", "two sources are mounted at /x"),
        ("no sources", workspace(sources=[]), None, "InvalidWorkspace", "at least one source"),
        ("a baseUrl that is no URL", workspace(providers=[
            {"name": "x", "kind": "ollama", "model": "m", "baseUrl": "ftp:nowhere"}],
            defaultProvider=None), None, "InvalidWorkspace", "is not an http URL"),
        ("env setting the API key", workspace(env=[{"name": API_KEY_ENV, "value": "v"}]), None,
         "InvalidWorkspace", "is set from the provider"),
    ],
)  # fmt: skip
def test_a_workspace_that_cannot_be_used_says_why_with_a_reason(
    tried: str, found: dict[str, Any] | None, provider_ref: str | None, reason: str, says: str
) -> None:
    with pytest.raises(WorkspaceProblem) as raised:
        resolve(found, "ws", provider_ref, "")
    assert raised.value.reason == reason, tried
    assert says in str(raised.value), tried
    assert "\n" not in str(raised.value), tried


def test_upstreams_sample_resolves_to_its_ollama_and_refuses_its_anthropic_default() -> None:
    samples = upstream.local_samples()
    ws, task = samples["workspace.yaml"], samples["calibantask.yaml"]
    spec = parse_spec(task["spec"])
    assert (spec.workspace_ref, spec.provider_ref) == ("team-a-ws", "workers")
    binding = resolve(ws, "team-a-ws", spec.provider_ref, spec.model)
    assert (binding.kind, binding.model, binding.base_url) == (
        "ollama",
        "qwen2.5-coder",
        "http://127.0.0.1:11434/v1",
    )
    assert [(s.name, s.ref, s.path) for s in binding.sources] == [
        ("caliban", "main", "/work/caliban")
    ]
    with pytest.raises(WorkspaceProblem) as raised:
        resolve(ws, "team-a-ws", None, "")
    assert raised.value.reason == "UnsupportedProviderKind"


def test_a_pinned_binding_reads_back_the_same_and_holds_no_secret_value() -> None:
    binding = resolve(workspace(env=[{"name": "TEAM", "value": "a"}]), "ws", "gateway", "")
    pinned = json.loads(json.dumps(binding.to_status()))
    assert Binding.from_status(pinned) == binding
    assert pinned["provider"]["credentialsRef"] == {"secretName": SECRET_NAME, "key": "k"}
    # caliban-operator's own pin (another shape) is resolved again, not misread.
    assert Binding.from_status({"workspace": "ws", "providers": []}) is None
    assert Binding.from_status(None) is None


def test_the_pod_gets_the_provider_by_reference_and_an_init_container_for_the_sources() -> None:
    binding = resolve(workspace(), "ws", "gateway", "")
    parts = pod_parts(binding, "caliban-drain:dev")
    env = {e["name"]: e for e in parts["env"]}
    assert env[BASE_URL_ENV] == {"name": BASE_URL_ENV, "value": "http://127.0.0.1:8080/v1"}
    assert env[API_KEY_ENV] == {"name": API_KEY_ENV, "valueFrom": {
        "secretKeyRef": {"name": SECRET_NAME, "key": "k"}}}  # fmt: skip
    assert parts["volumeMounts"] == [
        {"name": "workspace", "mountPath": "/work/app", "subPath": "sources/app"}
    ]
    [init] = parts["initContainers"]
    assert init["args"] == ["sources", "--into", "/workspace/sources"]
    assert json.loads(init["env"][0]["value"]) == [
        {"name": "app", "repo": "file:///srv/app.git", "ref": "main"}
    ]
    keyless = pod_parts(resolve(workspace(), "ws", "workers", ""), "img")
    assert API_KEY_ENV not in {e["name"] for e in keyless["env"]}


def test_the_sandbox_of_a_bound_task_runs_the_workspaces_provider() -> None:
    task: dict[str, Any] = {
        "apiVersion": crd.API_VERSION, "kind": crd.KIND,
        "metadata": {"name": "demo", "namespace": "team-a", "uid": "6f1c2f5e"},
        "spec": {"workspaceRef": {"name": "ws"}, "providerRef": "gateway",
                 "task": {"prompt": "refactor"}},
    }  # fmt: skip
    settings = Settings(broker_url="redis://127.0.0.1:6379/0")
    spec = parse_spec(copy.deepcopy(task["spec"])).with_sandbox_api_version(crd.SANDBOX_V1BETA1)
    bound = spec.with_binding(resolve(workspace(), "ws", spec.provider_ref, spec.model))
    task_ref = TaskRef("team-a", "demo", "6f1c2f5e")
    body = sandbox(task_ref, bound, "ws-demo", PodSettings.of(settings))
    pod = body["spec"]["podTemplate"]["spec"]
    [daemon] = pod["containers"]
    args = daemon["args"]
    assert args[args.index("--initial-provider") + 1] == "openai"
    assert args[args.index("--initial-model") + 1] == "gpt-local"
    assert [c["name"] for c in pod["initContainers"]] == ["sources"]
    assert pod["initContainers"][0]["image"] == daemon["image"]
    names = [e["name"] for e in daemon["env"]]
    assert {BASE_URL_ENV, API_KEY_ENV} <= set(names)
    assert {"mountPath": "/work/app", "name": "workspace", "subPath": "sources/app"} in daemon[
        "volumeMounts"
    ]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"workspaceRef": {"name": "Not A Name"}}, "workspaceRef.name"),
        ({"workspaceRef": "ws"}, "workspaceRef"),  # not an object: the reference itself
        ({"workspaceRef": {"name": "ws"}, "providerRef": 7}, "providerRef"),
        ({"providerRef": "workers"}, "providerRef"),
    ],
)
def test_a_malformed_workspace_or_provider_ref_is_an_invalid_spec(
    spec: dict[str, Any], field: str
) -> None:
    with pytest.raises(SpecError) as raised:
        parse_spec({"task": {}, **spec})
    assert raised.value.field == field


def test_an_operation_that_has_not_moved_writes_no_status() -> None:
    """``status.lastOperation`` as the API stores it after a merge patch (no null fields):
    a pass over an operation still on its way finds nothing to write (it wrote the whole
    field again every follow-up, each write a watch event, while nulls were sent)."""
    from orchestrator.ledger import OperationKind, OperationState, OperationView
    from orchestrator.operator.lifecycle import status_patch
    from orchestrator.operator.taskpass import operation_status

    now = datetime.now(UTC)
    op = OperationView(
        id="op-1", kind=OperationKind.PAUSE, task_uid="u", namespace="default", name="t",
        state=OperationState.DRAINING, idempotency_key="k", checkpoint_ref=None,
        grace_secs=30.0, celery_task_ids={}, detail=None, error=None, created_at=now,
        updated_at=now, deadline_at=None, finished_at=None,
    )  # fmt: skip
    written = operation_status(op)
    stored = {k: v for k, v in written.items() if v is not None}  # what a merge patch keeps
    assert status_patch({"lastOperation": stored}, {"lastOperation": written}) == {}
    assert "error" not in written and "finishedAt" not in written
