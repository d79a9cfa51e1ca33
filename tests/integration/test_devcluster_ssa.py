"""Server-side apply in the embedded Kubernetes API, driven by the real ``kubectl`` and the
kubernetes Python client: field managers in ``metadata.managedFields``, fields an applier
stops setting removed, conflicts with other managers' fields (and ``--force-conflicts``),
and the apply an operator makes of its children (``field_manager``, ``force=True``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from tests.integration.test_devcluster import CRD, GROUP, TASKS, VERSION, Cluster

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs the kubectl binary")

APPLY = "application/apply-patch+yaml"
CONFIGMAPS = "/api/v1/namespaces/default/configmaps"
SANDBOX_CRD = (
    Path(__file__).resolve().parents[2]
    / "orchestrator/devcluster/crds/agent-sandbox/agents.x-k8s.io_sandboxes.yaml"
)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    running = Cluster(tmp_path)
    try:
        yield running
    finally:
        running.close()


def configmap(**data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "settings", "labels": {"app": "drain"}},
        "data": data,
    }


def server_side(
    cluster: Cluster, manifest: dict[str, Any], *flags: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl(
        "apply", "--server-side", *flags, "-f", "-", stdin=json.dumps(manifest), check=check
    )


def managers(cluster: Cluster, target: str) -> dict[str, dict[str, Any]]:
    """``kubectl get -o yaml --show-managed-fields``'s managedFields, by manager."""
    shown = yaml.safe_load(
        cluster.kubectl("get", target, "-o", "yaml", "--show-managed-fields").stdout
    )
    return {entry["manager"]: entry for entry in shown["metadata"]["managedFields"]}


def python_client(cluster: Cluster) -> kubernetes.client.ApiClient:
    config = kubernetes.client.Configuration()
    config.host = cluster.url
    return kubernetes.client.ApiClient(config)


# ------------------------------------------------------------------ kubectl


def test_kubectl_server_side_apply_creates_then_removes_a_field_dropped_from_the_file(
    cluster: Cluster,
) -> None:
    created = server_side(cluster, configmap(mode="fast", level="3"))
    assert "configmap/settings serverside-applied" in created.stdout
    assert cluster.get(f"{CONFIGMAPS}/settings")["data"] == {"mode": "fast", "level": "3"}

    server_side(cluster, configmap(mode="slow"))
    assert cluster.get(f"{CONFIGMAPS}/settings")["data"] == {"mode": "slow"}

    plain = yaml.safe_load(cluster.kubectl("get", "configmap/settings", "-o", "yaml").stdout)
    assert "managedFields" not in plain["metadata"]
    entry = managers(cluster, "configmap/settings")["kubectl"]
    assert entry["operation"] == "Apply"
    assert entry["apiVersion"] == "v1"
    assert entry["fieldsType"] == "FieldsV1"
    assert entry["fieldsV1"] == {
        "f:data": {"f:mode": {}},
        "f:metadata": {"f:labels": {"f:app": {}}},
    }


def test_a_conflicting_apply_fails_until_it_forces_and_then_owns_the_field(
    cluster: Cluster,
) -> None:
    server_side(cluster, configmap(mode="fast"))
    refused = server_side(cluster, configmap(mode="slow"), "--field-manager=other", check=False)
    assert refused.returncode == 1
    assert 'Apply failed with 1 conflict: conflict with "kubectl": .data.mode' in refused.stderr, (
        refused.stderr
    )
    assert cluster.get(f"{CONFIGMAPS}/settings")["data"] == {"mode": "fast"}

    server_side(cluster, configmap(mode="slow"), "--field-manager=other", "--force-conflicts")
    assert cluster.get(f"{CONFIGMAPS}/settings")["data"] == {"mode": "slow"}
    owned = managers(cluster, "configmap/settings")
    assert owned["other"]["fieldsV1"]["f:data"] == {"f:mode": {}}
    assert "f:data" not in owned["kubectl"]["fieldsV1"]  # the label is still its own


def test_the_same_value_applied_by_two_managers_is_shared(cluster: Cluster) -> None:
    server_side(cluster, configmap(mode="fast"))
    server_side(cluster, configmap(mode="fast"), "--field-manager=other")
    owned = managers(cluster, "configmap/settings")
    assert owned["kubectl"]["fieldsV1"] == owned["other"]["fieldsV1"]


def test_a_field_kubectl_patch_set_conflicts_with_an_apply_by_another_manager(
    cluster: Cluster,
) -> None:
    server_side(cluster, configmap(mode="fast"))
    cluster.patch("configmap/settings", '{"data":{"mode":"patched"}}')
    owned = managers(cluster, "configmap/settings")
    assert owned["kubectl-patch"]["operation"] == "Update"
    assert owned["kubectl-patch"]["fieldsV1"] == {"f:data": {"f:mode": {}}}
    refused = server_side(cluster, configmap(mode="applied"), "--field-manager=ops", check=False)
    assert refused.returncode == 1
    assert 'conflict with "kubectl-patch" using v1: .data.mode' in refused.stderr, refused.stderr


def test_a_field_kubectl_edit_set_conflicts_with_an_apply_by_another_manager(
    cluster: Cluster,
) -> None:
    server_side(cluster, configmap(mode="fast"))
    edit = subprocess.run(
        cluster.kubectl_command("edit", "configmap/settings"),
        env={**os.environ, "KUBE_EDITOR": "sed -i s/fast/edited/"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert edit.returncode == 0, edit.stderr
    assert managers(cluster, "configmap/settings")["kubectl-edit"]["operation"] == "Update"
    refused = server_side(cluster, configmap(mode="mine"), "--field-manager=ops", check=False)
    assert 'conflict with "kubectl-edit" using v1: .data.mode' in refused.stderr, refused.stderr


def test_an_object_created_client_side_conflicts_on_the_fields_its_creator_set(
    cluster: Cluster,
) -> None:
    cluster.kubectl("create", "-f", "-", stdin=json.dumps(configmap(mode="fast")))
    assert managers(cluster, "configmap/settings")["kubectl-create"]["operation"] == "Update"
    refused = server_side(cluster, configmap(mode="slow"), check=False)
    assert 'conflict with "kubectl-create" using v1: .data.mode' in refused.stderr


def test_server_side_apply_of_a_custom_resource_removes_dropped_spec_fields(
    cluster: Cluster,
) -> None:
    cluster.apply(CRD)
    manifest = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "CalibanTask",
        "metadata": {"name": "t"},
        "spec": {"task": {"agents": 2}, "lifecycle": {"idleTimeout": "5m"}},
    }
    server_side(cluster, manifest)
    manifest["spec"] = {"task": {"agents": 3}}
    server_side(cluster, manifest)
    assert cluster.get(f"{TASKS}/t")["spec"] == {"task": {"agents": 3}}
    # Fields the schema does not declare (it preserves unknown fields) are map elements,
    # members themselves, as a real server records them.
    assert managers(cluster, "calibantask/t")["kubectl"]["fieldsV1"]["f:spec"] == {
        ".": {},
        "f:task": {".": {}, "f:agents": {}},
    }


# ------------------------------------------------------------------ raw HTTP


def test_an_apply_must_name_its_field_manager_and_match_the_resource(cluster: Cluster) -> None:
    status, body = cluster.request("PATCH", f"{CONFIGMAPS}/settings", configmap(mode="x"), APPLY)
    assert (status, body["reason"]) == (422, "Invalid")
    assert body["message"] == (
        'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: '
        "is required for apply patch"
    )
    wrong_kind = {**configmap(mode="x"), "kind": "Secret"}
    status, body = cluster.request(
        "PATCH", f"{CONFIGMAPS}/settings?fieldManager=m", wrong_kind, APPLY
    )
    assert (status, body["message"]) == (400, "invalid object type: /v1, Kind=Secret")
    status, body = cluster.request(
        "PATCH",
        f"{CONFIGMAPS}/settings?fieldManager=m&force=true",
        {"data": {}},
        "application/merge-patch+json",
    )
    assert status == 422 and "force: Forbidden" in body["message"]


def test_a_conflict_answers_409_with_field_manager_causes(cluster: Cluster) -> None:
    server_side(cluster, configmap(mode="fast"))
    status, body = cluster.request(
        "PATCH", f"{CONFIGMAPS}/settings?fieldManager=other", configmap(mode="slow"), APPLY
    )
    assert (status, body["reason"]) == (409, "Conflict")
    assert body["details"]["causes"] == [
        {
            "reason": "FieldManagerConflict",
            "message": 'conflict with "kubectl"',
            "field": ".data.mode",
        }
    ]


def test_managed_fields_sent_in_an_update_are_kept_only_as_a_real_server_allows(
    cluster: Cluster,
) -> None:
    server_side(cluster, configmap(mode="fast"))
    bogus = {"metadata": {"managedFields": [{"manager": "x", "operation": "Bogus"}]}}
    status, body = cluster.merge_patch(f"{CONFIGMAPS}/settings", bogus)
    assert status == 200 and [e["manager"] for e in body["metadata"]["managedFields"]] == [
        "kubectl"
    ]
    status, body = cluster.merge_patch(
        f"{CONFIGMAPS}/settings", {"metadata": {"managedFields": [{}]}}
    )
    assert status == 200 and "managedFields" not in body["metadata"]


def test_an_apply_to_the_status_subresource_touches_only_status(cluster: Cluster) -> None:
    cluster.apply(CRD)
    manifest = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "CalibanTask",
        "metadata": {"name": "t"},
        "spec": {"task": {"agents": 1}},
    }
    server_side(cluster, manifest)
    status_config = {**manifest, "spec": {"task": {"agents": 9}}, "status": {"phase": "Running"}}
    status, body = cluster.request(
        "PATCH", f"{TASKS}/t/status?fieldManager=controller", status_config, APPLY
    )
    assert status == 200, body
    assert body["spec"] == {"task": {"agents": 1}} and body["status"] == {"phase": "Running"}
    entry = next(e for e in body["metadata"]["managedFields"] if e["manager"] == "controller")
    assert entry["subresource"] == "status"
    assert entry["fieldsV1"] == {"f:status": {".": {}, "f:phase": {}}}


# ------------------------------------------------------------------ the Python client


def test_the_python_client_applies_a_service_account_with_force(cluster: Cluster) -> None:
    core = kubernetes.client.CoreV1Api(python_client(cluster))
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "runner", "labels": {"a": "1", "b": "2"}},
        "automountServiceAccountToken": False,
    }
    created = core.patch_namespaced_service_account(
        "runner",
        "default",
        body,
        field_manager="caliban-drain",
        force=True,
        _content_type=APPLY,
    )
    assert created.metadata.labels == {"a": "1", "b": "2"}
    (entry,) = created.metadata.managed_fields
    assert (entry.manager, entry.operation) == ("caliban-drain", "Apply")

    cluster.patch("serviceaccount/runner", '{"automountServiceAccountToken":true}')
    body["metadata"]["labels"] = {"a": "1"}
    with pytest.raises(kubernetes.client.ApiException) as refused:
        core.patch_namespaced_service_account(
            "runner", "default", body, field_manager="caliban-drain", _content_type=APPLY
        )
    assert refused.value.status == 409
    assert ".automountServiceAccountToken" in json.loads(refused.value.body)["message"]
    applied = core.patch_namespaced_service_account(
        "runner", "default", body, field_manager="caliban-drain", force=True, _content_type=APPLY
    )
    assert applied.metadata.labels == {"a": "1"}
    assert applied.automount_service_account_token is False


def test_the_python_client_applies_a_sandbox_merging_containers_by_name(
    cluster: Cluster,
) -> None:
    cluster.kubectl("create", "-f", str(SANDBOX_CRD))
    api = kubernetes.client.CustomObjectsApi(python_client(cluster))

    def sandbox(*containers: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "agents.x-k8s.io/v1beta1",
            "kind": "Sandbox",
            "metadata": {"name": "sb"},
            "spec": {"podTemplate": {"spec": {"containers": list(containers)}}},
        }

    def apply(body: dict[str, Any], manager: str) -> dict[str, Any]:
        result: dict[str, Any] = api.patch_namespaced_custom_object(
            "agents.x-k8s.io",
            "v1beta1",
            "default",
            "sandboxes",
            "sb",
            body,
            field_manager=manager,
            force=True,
            _content_type=APPLY,
        )
        return result

    apply(sandbox({"name": "main", "image": "img:1"}), "caliban-drain")
    both = apply(sandbox({"name": "sidecar", "image": "side:1"}), "injector")
    assert [c["name"] for c in both["spec"]["podTemplate"]["spec"]["containers"]] == [
        "main",
        "sidecar",
    ]
    entry = next(e for e in both["metadata"]["managedFields"] if e["manager"] == "caliban-drain")
    assert entry["fieldsV1"]["f:spec"]["f:podTemplate"]["f:spec"]["f:containers"] == {
        'k:{"name":"main"}': {".": {}, "f:image": {}, "f:name": {}}
    }
    assert "f:operatingMode" not in entry["fieldsV1"]["f:spec"]  # a schema default

    after = apply(sandbox({"name": "main", "image": "img:2"}), "caliban-drain")
    assert [
        (c["name"], c["image"]) for c in after["spec"]["podTemplate"]["spec"]["containers"]
    ] == [("main", "img:2"), ("sidecar", "side:1")]
