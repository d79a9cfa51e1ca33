"""agent-sandbox's Sandbox CRD in the embedded API: the built-in conversion standing in for
its webhook (``orchestrator.devcluster.conversion``), the endpoints it serves with it, and
its typed pod template, which must keep every field of the pod the operator writes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.devcluster import schema
from orchestrator.devcluster.conversion import sandbox_converted
from orchestrator.devcluster.resources import CrdError, served_from_crd
from orchestrator.devcluster.up import stack_crds
from orchestrator.operator import children, crd
from orchestrator.operator.lifecycle import parse_spec
from orchestrator.operator.workspace import resolve
from orchestrator.settings import Settings

REPO = Path(__file__).resolve().parents[2]
SANDBOX_CRD_FILE = (
    REPO / "orchestrator" / "devcluster" / "crds" / "agent-sandbox"
    / "agents.x-k8s.io_sandboxes.yaml"
)  # fmt: skip
POD_TEMPLATE = {"spec": {"containers": [{"name": "caliband", "image": "caliband:dev"}]}}


@pytest.fixture(scope="module")
def sandbox_crd() -> dict[str, Any]:
    loaded = yaml.safe_load(SANDBOX_CRD_FILE.read_text())
    assert isinstance(loaded, dict)
    return loaded


def sandbox(version: str, spec: dict[str, Any], status: dict[str, Any] | None = None) -> Any:
    obj: dict[str, Any] = {
        "apiVersion": f"agents.x-k8s.io/{version}", "kind": "Sandbox",
        "metadata": {"name": "t-sbx", "namespace": "default", "labels": {"a": "b"}},
        "spec": {"podTemplate": POD_TEMPLATE, **spec},
    }  # fmt: skip
    if status is not None:
        obj["status"] = status
    return obj


# ------------------------------------------------------------------ the conversion


@pytest.mark.parametrize(
    ("alpha_spec", "beta_mode"),
    [
        pytest.param({"replicas": 0}, "Suspended", id="replicas-0-is-suspended"),
        pytest.param({"replicas": 1}, "Running", id="replicas-1-is-running"),
        pytest.param({}, "Running", id="replicas-unset-is-running"),
    ],
)
def test_v1alpha1_replicas_become_v1beta1_operating_mode(
    alpha_spec: dict[str, Any], beta_mode: str
) -> None:
    beta = sandbox_converted(sandbox("v1alpha1", alpha_spec, {"replicas": 1}), "v1beta1")
    assert beta["apiVersion"] == "agents.x-k8s.io/v1beta1"
    assert beta["spec"] == {"podTemplate": POD_TEMPLATE, "operatingMode": beta_mode}
    assert beta["status"] == {}  # status.replicas is v1alpha1's only
    assert beta["metadata"] == sandbox("v1alpha1", {})["metadata"]


@pytest.mark.parametrize(
    ("beta_spec", "alpha_replicas"),
    [
        pytest.param({"operatingMode": "Suspended"}, 0, id="suspended-is-0"),
        pytest.param({"operatingMode": "Running"}, 1, id="running-is-1"),
        pytest.param({}, 1, id="mode-unset-is-1"),
    ],
)
def test_v1beta1_operating_mode_becomes_v1alpha1_replicas(
    beta_spec: dict[str, Any], alpha_replicas: int
) -> None:
    status = {"nodeName": "dev", "serviceFQDN": "t-sbx.default.svc.cluster.local"}
    alpha = sandbox_converted(sandbox("v1beta1", beta_spec, status), "v1alpha1")
    assert alpha["apiVersion"] == "agents.x-k8s.io/v1alpha1"
    assert alpha["spec"] == {"podTemplate": POD_TEMPLATE, "replicas": alpha_replicas}
    # nodeName is v1beta1's only; status.replicas follows the mode, as upstream's webhook.
    assert alpha["status"] == {
        "serviceFQDN": "t-sbx.default.svc.cluster.local",
        "replicas": alpha_replicas,
    }


@pytest.mark.parametrize("version", ["v1alpha1", "v1beta1"])
def test_a_sandbox_at_its_own_version_is_unchanged_and_a_round_trip_is_lossless(
    version: str,
) -> None:
    spec = {"replicas": 0} if version == "v1alpha1" else {"operatingMode": "Suspended"}
    original = sandbox(version, {**spec, "shutdownPolicy": "Retain", "service": True})
    kept = copy.deepcopy(original)
    assert sandbox_converted(original, version) == original
    other = "v1beta1" if version == "v1alpha1" else "v1alpha1"
    assert sandbox_converted(sandbox_converted(original, other), version) == original
    assert original == kept  # never changed in place


# ------------------------------------------------------------------ the endpoints


def test_the_embedded_api_converts_where_the_crd_has_a_webhook(
    sandbox_crd: dict[str, Any],
) -> None:
    served = {r.version: r for r in served_from_crd(sandbox_crd)}
    alpha, beta = served["v1alpha1"], served["v1beta1"]
    assert (alpha.storage_key, beta.storage_key) == (
        ("agents.x-k8s.io", "v1beta1", "sandboxes"),
        ("agents.x-k8s.io", "v1beta1", "sandboxes"),
    )
    stored = alpha.to_storage(sandbox("v1alpha1", {"replicas": 0}))
    assert stored["apiVersion"] == "agents.x-k8s.io/v1beta1"
    assert stored["spec"]["operatingMode"] == "Suspended" and "replicas" not in stored["spec"]
    assert alpha.to_served(stored)["spec"]["replicas"] == 0
    assert beta.to_served(stored)["spec"]["operatingMode"] == "Suspended"
    assert alpha.deprecation_warning == (
        "agents.x-k8s.io/v1alpha1 Sandbox is deprecated; use agents.x-k8s.io/v1beta1 Sandbox "
        "instead"
    )
    assert beta.deprecation_warning is None
    # The real printer columns, where the version declares them.
    assert [c.name for c in beta.columns] == ["Ready", "Reason", "Age"]


def test_a_webhook_crd_with_no_built_in_conversion_is_refused(
    sandbox_crd: dict[str, Any],
) -> None:
    other = copy.deepcopy(sandbox_crd)
    other["metadata"]["name"] = "sandboxes.example.com"
    other["spec"]["group"] = "example.com"
    with pytest.raises(CrdError, match="no built-in conversion for this CRD"):
        served_from_crd(other)


def test_the_v1alpha1_only_dev_cluster_serves_and_stores_v1alpha1_with_no_conversion() -> None:
    [alpha_only] = [
        c for c in stack_crds("v1alpha1", snapshots=False)
        if c["metadata"]["name"] == crd.SANDBOX_CRD
    ]  # fmt: skip
    versions = alpha_only["spec"]["versions"]
    assert [(v["name"], v["served"], v["storage"]) for v in versions] == [("v1alpha1", True, True)]
    assert "deprecated" not in versions[0]
    assert alpha_only["spec"]["conversion"] == {"strategy": "None"}
    [default] = [
        c for c in stack_crds("v1beta1", snapshots=False)
        if c["metadata"]["name"] == crd.SANDBOX_CRD
    ]  # fmt: skip
    assert default == yaml.safe_load(SANDBOX_CRD_FILE.read_text())
    with pytest.raises(ValueError, match="--sandbox-storage 'v2'"):
        stack_crds("v2")


# ------------------------------------------------------------------ validation, pruning


@pytest.mark.parametrize(
    ("version", "spec", "message"),
    [
        pytest.param("v1beta1", {"operatingMode": "Paused"},
                     'spec.operatingMode: Unsupported value: "Paused": supported values: '
                     '"Running", "Suspended"', id="beta-mode"),
        pytest.param("v1alpha1", {"replicas": 2},
                     "spec.replicas: Invalid value: 2: spec.replicas in body should be less "
                     "than or equal to 1", id="alpha-replicas"),
    ],
)  # fmt: skip
def test_a_sandbox_outside_the_crds_enum_or_bounds_is_refused_naming_the_field(
    sandbox_crd: dict[str, Any], version: str, spec: dict[str, Any], message: str
) -> None:
    [served] = [r for r in served_from_crd(sandbox_crd) if r.version == version]
    assert served.schema is not None
    pruned, _ = schema.prune_and_default(sandbox(version, spec), served.schema)
    assert [e.message for e in schema.validate(pruned, served.schema)] == [message]


def operators_sandbox() -> dict[str, Any]:
    """The Sandbox the operator writes for a task bound to a Workspace (an init container,
    the provider's key by secretKeyRef, probes, volumes) with a user pod template merged
    under it (resources, tolerations, a node selector and affinity)."""
    workspace: dict[str, Any] = {
        "apiVersion": crd.API_VERSION, "kind": crd.WORKSPACE_KIND, "metadata": {"name": "ws"},
        "spec": {
            "sources": [{"name": "app", "repo": "file:///srv/app.git", "path": "/work/app"}],
            "providers": [{"name": "gateway", "kind": "openai", "model": "gpt-local",
                           "baseUrl": "http://127.0.0.1:8080/v1",
                           "credentialsRef": {"secretName": "gateway-key", "key": "k"}}],
        },
    }  # fmt: skip
    template = {
        "metadata": {"labels": {"team": "a"}, "annotations": {"note": "mine"}},
        "spec": {
            "tolerations": [{"key": "agents", "operator": "Exists", "effect": "NoSchedule"}],
            "nodeSelector": {"pool": "agents"},
            "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [
                    {"key": "zone", "operator": "In", "values": ["a"]}]}}]}},
            "containers": [{
                "name": "caliband",
                "resources": {"limits": {"memory": "2Gi", "cpu": 2},
                              "requests": {"cpu": "500m"}},
            }],
        },
    }  # fmt: skip
    task: dict[str, Any] = {
        "apiVersion": crd.API_VERSION, "kind": crd.KIND,
        "metadata": {"name": "demo", "namespace": "team-a", "uid": "6f1c2f5e"},
        "spec": {"workspaceRef": {"name": "ws"}, "providerRef": "gateway",
                 "task": {"prompt": "refactor"}, "sandbox": {"podTemplate": template}},
    }  # fmt: skip
    pod = children.PodSettings.of(Settings(broker_url="redis://127.0.0.1:6379/0"))
    spec = parse_spec(copy.deepcopy(task["spec"])).with_sandbox_api_version(crd.SANDBOX_V1BETA1)
    bound = spec.with_binding(resolve(workspace, "ws", "gateway", ""))
    return children.sandbox(children.TaskRef("team-a", "demo", "6f1c2f5e"), bound, "ws-demo", pod)


@pytest.mark.parametrize("version", ["v1beta1", "v1alpha1"])
def test_the_pod_the_operator_writes_survives_the_typed_pod_template_whole(
    sandbox_crd: dict[str, Any], version: str
) -> None:
    body = operators_sandbox()
    pod = body["spec"]["podTemplate"]["spec"]
    # The parts the schema must know, present before it is applied.
    assert pod["initContainers"] and pod["securityContext"] and pod["tolerations"]
    daemon = pod["containers"][0]
    assert any("secretKeyRef" in (e.get("valueFrom") or {}) for e in daemon["env"])
    assert daemon["livenessProbe"]["httpGet"]["port"] == "metrics"
    [served] = [r for r in served_from_crd(sandbox_crd) if r.version == version]
    assert served.schema is not None
    at_version = sandbox_converted(body, version)
    pruned, unknown = schema.prune_and_default(at_version, served.schema)
    assert unknown == []
    assert schema.validate(pruned, served.schema) == []
    # Whole: nothing pruned, only the API server's one default added (a port's protocol).
    expected = copy.deepcopy(body["spec"]["podTemplate"])
    for port in expected["spec"]["containers"][0]["ports"]:
        port["protocol"] = "TCP"
    assert pruned["spec"]["podTemplate"] == expected
    assert pruned["spec"]["operatingMode" if version == "v1beta1" else "replicas"] in (
        "Running",
        1,
    )
