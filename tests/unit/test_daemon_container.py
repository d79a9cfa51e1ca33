"""The daemon container the operator writes into each provisioned Sandbox: its probes and
metrics port, the broker URL by reference only, and the operator's log format."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest

from orchestrator.operator import crd
from orchestrator.operator.children import PodSettings, TaskRef, sandbox
from orchestrator.operator.lifecycle import TaskSpec, parse_spec
from orchestrator.settings import Settings
from worker_agent.settings import DaemonSettings

TASK: dict[str, Any] = {
    "apiVersion": crd.API_VERSION,
    "kind": crd.KIND,
    "metadata": {"name": "demo", "namespace": "team-a", "uid": "6f1c2f5e-0d7a-4f7e-9d61"},
    "spec": {"task": {"agents": 2, "provider": "scripted"}},
}


DEMO = TaskRef("team-a", "demo", "6f1c2f5e-0d7a-4f7e-9d61")


def resolved(spec: dict[str, Any]) -> TaskSpec:
    """``spec`` parsed, its Sandbox version resolved as the operator resolves an unset one
    on a cluster serving v1beta1."""
    return parse_spec(spec).with_sandbox_api_version(crd.SANDBOX_V1BETA1)


BROKER = "redis://:hunter2-secret@broker.team-a:6379/0"


def daemon_container(monkeypatch: pytest.MonkeyPatch, log_format: str) -> dict[str, Any]:
    monkeypatch.setenv("DRAIN_LOG_FORMAT", log_format)
    settings = Settings(broker_url=BROKER, result_backend="redis://127.0.0.1:6379/1")
    pod = PodSettings.of(settings)
    body = sandbox(DEMO, resolved(dict(TASK["spec"])), "ws-demo", pod)
    [container] = body["spec"]["podTemplate"]["spec"]["containers"]
    return cast(dict[str, Any], container)


def test_the_daemon_serves_its_probes_on_the_port_the_container_declares(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    container = daemon_container(monkeypatch, "text")
    args = container["args"]
    assert args[args.index("--metrics-port") + 1] == str(crd.DAEMON_METRICS_PORT)
    assert container["ports"] == [{"name": "metrics", "containerPort": crd.DAEMON_METRICS_PORT}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    # The daemon's own default is the same port, so a pod built by hand matches too.
    assert DaemonSettings.model_fields["metrics_port"].default == crd.DAEMON_METRICS_PORT
    # Served on the pod's own address (where the kubelet and the scrape reach), not on
    # every interface: the daemon reads the host from this variable.
    env = {e["name"]: e for e in container["env"]}
    assert env["DRAIN_DAEMON_METRICS_HOST"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "status.podIP"}
    }
    monkeypatch.setenv("DRAIN_DAEMON_METRICS_HOST", "127.0.0.7")
    assert DaemonSettings().metrics_host == "127.0.0.7"


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_the_daemon_logs_in_the_operators_format_and_never_sees_the_url_inline(
    monkeypatch: pytest.MonkeyPatch, log_format: str
) -> None:
    container = daemon_container(monkeypatch, log_format)
    env = {e["name"]: e for e in container["env"]}
    assert env["DRAIN_LOG_FORMAT"] == {"name": "DRAIN_LOG_FORMAT", "value": log_format}
    assert "value" not in env[crd.BROKER_URL_ENV]
    assert "hunter2-secret" not in json.dumps(container)


def test_the_sandbox_the_operator_makes_is_named_task_sbx_and_owned_by_the_task() -> None:
    settings = Settings(broker_url=BROKER, result_backend="redis://127.0.0.1:6379/1")
    pod = PodSettings.of(settings)
    spec = resolved(dict(TASK["spec"]))
    body = sandbox(DEMO, spec, "ws-demo", pod)
    assert body["metadata"]["name"] == "demo-sbx" == crd.sandbox_name(DEMO.name, spec.sandbox_name)
    assert body["spec"]["podTemplate"]["spec"]["serviceAccountName"] == "demo-sa"
    assert [o["uid"] for o in body["metadata"]["ownerReferences"]] == [TASK["metadata"]["uid"]]
    named = resolved({**TASK["spec"], "sandbox": {"name": "shared"}})
    assert crd.sandbox_name(DEMO.name, named.sandbox_name) == "shared"


def test_the_sandbox_says_caliban_drain_manages_it_and_its_pod_template_does_not() -> None:
    """The pod is the Sandbox controller's: it carries the task and component labels that
    select it, not a claim that this operator manages it."""
    settings = Settings(broker_url=BROKER, result_backend="redis://127.0.0.1:6379/1")
    body = sandbox(DEMO, resolved(dict(TASK["spec"])), "ws-demo", PodSettings.of(settings))
    assert body["metadata"]["labels"] == {
        crd.TASK_LABEL: "demo", "app.kubernetes.io/managed-by": "caliban-drain",
    }  # fmt: skip
    assert body["spec"]["podTemplate"]["metadata"]["labels"] == {
        crd.TASK_LABEL: "demo", crd.COMPONENT_LABEL: crd.DAEMON_COMPONENT,
    }  # fmt: skip


def test_the_tasks_image_and_env_land_in_the_daemon_container_after_ours() -> None:
    settings = Settings(broker_url=BROKER, result_backend="redis://127.0.0.1:6379/1")
    pod = PodSettings.of(settings)
    default = sandbox(DEMO, resolved(dict(TASK["spec"])), "ws-demo", pod)
    [plain] = default["spec"]["podTemplate"]["spec"]["containers"]
    assert plain["image"] == settings.daemon_image
    task = {"agents": 2, "image": "reg.example/caliband:1", "env": [{"name": "A", "value": "1"}]}
    body = sandbox(DEMO, resolved({"task": task}), "ws-demo", pod)
    [container] = body["spec"]["podTemplate"]["spec"]["containers"]
    assert container["image"] == "reg.example/caliband:1"
    assert container["env"] == [*plain["env"], {"name": "A", "value": "1"}]


def test_the_sandbox_pod_template_of_the_spec_is_merged_under_ours() -> None:
    settings = Settings(broker_url=BROKER, result_backend="redis://127.0.0.1:6379/1")
    template = {
        "metadata": {"labels": {"team": "a"}},
        "spec": {
            "nodeSelector": {"pool": "agents"},
            "containers": [{"name": "caliband", "resources": {"limits": {"memory": "2Gi"}}}],
        },
    }
    spec = resolved({**TASK["spec"], "sandbox": {"podTemplate": template}})
    written = sandbox(DEMO, spec, "ws-demo", PodSettings.of(settings))["spec"]["podTemplate"]
    assert written["metadata"]["labels"]["team"] == "a"
    assert written["metadata"]["labels"][crd.TASK_LABEL] == "demo"
    assert written["spec"]["nodeSelector"] == {"pool": "agents"}
    assert written["spec"]["serviceAccountName"] == "demo-sa"
    [container] = written["spec"]["containers"]
    assert container["resources"] == {"limits": {"memory": "2Gi"}}
    assert container["command"] == ["drainctl"]
