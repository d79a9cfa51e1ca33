"""Which spec edits roll a running task's pod: the hash of what its pod is made of
(``children.pod_template_hash``) changes with the image, env, podTemplate, resources and
runtime class, and not with what the daemon takes without a new pod (agents, model,
prompt, drain grace); a pause that rolls resumes at once unless the spec holds it."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.operator import crd
from orchestrator.operator.children import PodSettings, TaskRef, pod_template_hash, sandbox
from orchestrator.operator.lifecycle import ROLLED, Phase, Wanted, parse_spec, wanted_transition
from orchestrator.settings import Settings

BASE: dict[str, Any] = {"task": {"agents": 2, "provider": "scripted", "model": "turns=5"}}


def template_of(spec: dict[str, Any]) -> dict[str, Any]:
    pod = PodSettings.of(Settings(broker_url="redis://127.0.0.1:6379/0"))
    task = TaskRef("team-a", "demo", "6f1c2f5e-0d7a-4f7e-9d61")
    parsed = parse_spec(spec).with_sandbox_api_version(crd.SANDBOX_V1BETA1)
    template: dict[str, Any] = sandbox(task, parsed, "ws", pod)["spec"]["podTemplate"]
    return template


def edited(**parts: Any) -> dict[str, Any]:
    spec = {**BASE, **parts}
    spec["task"] = {**BASE["task"], **parts.get("task", {})}
    return spec


def test_the_template_carries_its_own_hash() -> None:
    template = template_of(BASE)
    annotations = template["metadata"]["annotations"]
    assert annotations[crd.POD_TEMPLATE_ANNOTATION] == pod_template_hash(template)


@pytest.mark.parametrize(
    "spec",
    [
        edited(task={"image": "registry.local/caliban-drain:next"}),
        edited(task={"env": [{"name": "FEATURE", "value": "on"}]}),
        edited(isolation={"runtimeClass": "gvisor"}),
        edited(sandbox={"podTemplate": {"spec": {"nodeSelector": {"pool": "agents"}}}}),
        edited(sandbox={"podTemplate": {"metadata": {"labels": {"team": "a"}}}}),
        edited(
            sandbox={
                "podTemplate": {
                    "spec": {
                        "containers": [
                            {"name": "caliband", "resources": {"limits": {"memory": "2Gi"}}}
                        ]
                    }
                }
            }
        ),
    ],
    ids=["image", "env", "runtime-class", "node-selector", "pod-label", "resources"],
)
def test_an_edit_of_what_the_pod_is_made_of_changes_the_hash(spec: dict[str, Any]) -> None:
    assert pod_template_hash(template_of(spec)) != pod_template_hash(template_of(BASE))


@pytest.mark.parametrize(
    "spec",
    [
        edited(task={"agents": 5}),
        edited(task={"model": "turns=9,turn_ms=10"}),
        edited(task={"prompt": "another task"}),
        edited(lifecycle={"drainGracePeriod": "90s"}),
    ],
    ids=["agents", "model", "prompt", "drain-grace"],
)
def test_what_the_daemon_takes_without_a_new_pod_keeps_the_hash(spec: dict[str, Any]) -> None:
    assert template_of(spec) != template_of(BASE)  # the daemon's arguments differ
    assert pod_template_hash(template_of(spec)) == pod_template_hash(template_of(BASE))


def test_a_rolling_pause_resumes_at_once_unless_the_spec_holds_it() -> None:
    running = parse_spec(BASE)
    held = parse_spec(edited(lifecycle={"suspend": True}))
    assert wanted_transition(running, Phase.SUSPENDED, ROLLED, None, None) is Wanted.RESUME
    assert wanted_transition(held, Phase.SUSPENDED, ROLLED, None, None) is Wanted.ADOPT
