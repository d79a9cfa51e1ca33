"""A Workspace's status as this operator writes it (``orchestrator.operator.workspace_status``,
from ``workspace.validate``): caliban-operator's fields (phase, message,
observedGeneration) with the same meaning, a Ready condition with the reason, nothing
written when the stored status already says it, and written at all only where
``DRAIN_WORKSPACE_STATUS`` says so."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from orchestrator.operator import crd
from orchestrator.operator.workspace_status import desired, update
from orchestrator.settings import Settings
from tests import upstream

NOW = datetime(2026, 7, 20, 10, 0, tzinfo=UTC)
LATER = NOW + timedelta(minutes=5)


def workspace(generation: int = 1, status: Any = None, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "displayName": "Team A",
        "sources": [{"name": "app", "repo": "file:///srv/app.git", "path": "/work/app"}],
        "providers": [
            {"name": "workers", "kind": "ollama"},  # no model: a task may name its own
            {"name": "gateway", "kind": "openai", "baseUrl": "http://127.0.0.1:8080/v1",
             "credentialsRef": {"secretName": "gateway-key", "key": "k"}},
        ],
        "defaultProvider": "workers",
    }  # fmt: skip
    base.update(spec)
    obj: dict[str, Any] = {
        "apiVersion": crd.API_VERSION, "kind": crd.WORKSPACE_KIND,
        "metadata": {"name": "ws", "namespace": "team-a", "generation": generation},
        "spec": base,
    }  # fmt: skip
    if status is not None:
        obj["status"] = status
    return obj


def stored(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` as the API keeps it after a merge patch: its nulls removed."""
    return {k: v for k, v in status.items() if v is not None}


def test_a_usable_workspace_is_ready_for_its_generation_with_no_message() -> None:
    status = desired(workspace(generation=3), NOW)
    assert (status["phase"], status["message"], status["observedGeneration"]) == ("Ready", None, 3)
    assert status["conditions"] == [{
        "type": "Ready", "status": "True", "reason": "Valid",
        "message": "Workspace ws: its 2 provider(s) and 1 source(s) can be used",
        "lastTransitionTime": "2026-07-20T10:00:00Z", "observedGeneration": 3,
    }]  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "reason", "message"),
    [
        ({"providers": [{"name": "planner", "kind": "anthropic", "model": "claude"}],
          "defaultProvider": None}, "UnsupportedProviderKind",
         "provider planner of Workspace ws is of kind anthropic, which caliban-drain cannot "
         "drive yet (it drives ollama, openai, openai-compatible); a task bound to it is "
         "refused"),
        ({"sources": [{"name": "app", "repo": "r", "path": "relative"}]}, "InvalidWorkspace",
         "Workspace ws: source app: path 'relative' is not an absolute path"),
        ({"sources": [{"name": "app", "repo": "r", "path": "/workspace/app"}]},
         "InvalidWorkspace",
         "Workspace ws: source app: path /workspace/app overlaps /workspace, which the daemon "
         "container mounts itself"),
        ({"defaultProvider": "nobody"}, "ProviderNotFound",
         "Workspace ws's defaultProvider names provider 'nobody', which it does not define "
         "(it has gateway, workers)"),
        ({"providers": [{"name": "p", "kind": "ollama"}, {"name": "p", "kind": "openai"}],
          "defaultProvider": None}, "InvalidWorkspace", "Workspace ws: provider p is listed twice"),
        ({"providers": [{"name": "gw", "kind": "openai"}], "defaultProvider": None},
         "ProviderNeedsBaseUrl",
         "provider gw of Workspace ws (kind openai) has no baseUrl; caliban-drain configures "
         "no remote endpoint by default"),
        ({"providers": [{"name": "gw", "kind": "openai", "baseUrl": "http://127.0.0.1:1/v1",
                         "credentialsRef": {"secretName": "s"}}], "defaultProvider": None},
         "InvalidWorkspace", "Workspace ws: provider gw: credentialsRef needs secretName and key"),
        ({"env": [{"name": "OPENAI_API_KEY", "value": "x"}]}, "InvalidWorkspace",
         "Workspace ws: env OPENAI_API_KEY is set from the provider and sources"),
    ],
    ids=["anthropic", "relative-path", "reserved-path", "dangling-default", "duplicate",
         "no-base-url", "half-a-secret-ref", "reserved-env"],
)  # fmt: skip
def test_an_unusable_workspace_is_failed_with_the_first_problem_and_its_reason(
    spec: dict[str, Any], reason: str, message: str
) -> None:
    status = desired(workspace(generation=2, **spec), NOW)
    assert (status["phase"], status["message"], status["observedGeneration"]) == (
        "Failed",
        message,
        2,
    )
    [ready] = status["conditions"]
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", reason, message)
    assert "\n" not in message


def test_upstreams_sample_is_failed_for_its_anthropic_planner() -> None:
    sample = upstream.local_samples()["workspace.yaml"]
    sample["metadata"]["generation"] = 1
    status = desired(sample, NOW)
    assert status["phase"] == "Failed"
    assert status["conditions"][0]["reason"] == "UnsupportedProviderKind"
    assert status["message"].startswith(
        "provider planner of Workspace team-a-ws is of kind anthropic"
    )


def test_without_the_anthropic_planner_upstreams_sample_is_ready() -> None:
    sample = upstream.local_samples()["workspace.yaml"]
    sample["spec"]["providers"] = [p for p in sample["spec"]["providers"] if p["name"] != "planner"]
    sample["spec"]["defaultProvider"] = "workers"
    assert desired(sample, NOW)["phase"] == "Ready"


def test_what_is_stored_already_is_not_written_again() -> None:
    first = update(workspace(), NOW)
    assert first is not None
    assert update(workspace(status=stored(first)), LATER) is None
    failed = workspace(defaultProvider="nobody")
    patch = update(failed, NOW)
    assert patch is not None
    assert update({**failed, "status": stored(patch)}, LATER) is None


def test_an_edit_is_observed_and_a_fix_removes_the_message() -> None:
    failed = workspace(generation=1, defaultProvider="nobody")
    failed["status"] = stored(desired(failed, NOW))
    # A new generation that changes nothing of the verdict is still observed.
    again = copy.deepcopy(failed)
    again["metadata"]["generation"] = 2
    patch = update(again, LATER)
    assert patch is not None and patch["observedGeneration"] == 2
    assert patch["conditions"][0]["lastTransitionTime"] == "2026-07-20T10:00:00Z"  # held
    # Fixed: Ready, the message removed (null in the merge patch), a new transition.
    fixed = copy.deepcopy(again)
    fixed["metadata"]["generation"] = 3
    fixed["spec"]["defaultProvider"] = "workers"
    patch = update(fixed, LATER)
    assert patch is not None
    assert (patch["phase"], patch["message"], patch["observedGeneration"]) == ("Ready", None, 3)
    assert patch["conditions"][0]["lastTransitionTime"] == "2026-07-20T10:05:00Z"


def test_other_writers_conditions_are_kept_and_upstreams_status_is_completed() -> None:
    theirs = {"phase": "Ready", "observedGeneration": 1,
              "conditions": [{"type": "Synced", "status": "True"},
                             {"type": "Ready", "status": "True"}]}  # fmt: skip
    patch = update(workspace(status=theirs), NOW)
    assert patch is not None  # the same phase, but no reason nor message on Ready yet
    assert [c["type"] for c in patch["conditions"]] == ["Synced", "Ready"]
    assert patch["conditions"][0] == {"type": "Synced", "status": "True"}
    assert patch["conditions"][1]["lastTransitionTime"] == "2026-07-20T10:00:00Z"


@pytest.mark.parametrize(
    ("setting", "manage_sandbox", "existing_sandboxes", "writes"),
    [
        ("auto", False, False, False),  # another controller provisions: its status
        ("auto", True, False, True),
        ("auto", True, True, False),  # caliban-operator makes the Sandboxes
        ("on", False, False, True),
        ("on", True, True, True),
        ("off", True, False, False),
    ],
)
def test_who_writes_the_status_follows_drain_workspace_status(
    monkeypatch: pytest.MonkeyPatch,
    setting: str,
    manage_sandbox: bool,
    existing_sandboxes: bool,
    writes: bool,
) -> None:
    monkeypatch.setenv("DRAIN_WORKSPACE_STATUS", setting)
    settings = Settings(manage_sandbox=manage_sandbox, existing_sandboxes=existing_sandboxes)
    assert settings.writes_workspace_status is writes


def test_a_workspace_status_setting_of_another_value_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DRAIN_WORKSPACE_STATUS", "sometimes")
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        Settings()
