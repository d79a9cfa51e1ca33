"""CRD validation rules (``x-kubernetes-validations``) as the real ``kubectl`` meets them
on the embedded API: an immutable field refused on ``kubectl patch`` and ``kubectl
apply`` with the rule's message and the field's path, other changes admitted, a CRD with
a rule that does not compile refused by ``kubectl apply``, and the project's own
CalibanTask CRD refusing a ``workspaceRef`` without ``task.prompt``."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.test_devcluster import Cluster

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs the kubectl binary")

REPO = Path(__file__).resolve().parents[2]
GROUP = "example.caliban-ai.dev"

WIDGETS: dict[str, Any] = {
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
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {
                                    "sandbox": {
                                        "type": "object",
                                        "properties": {
                                            "name": {
                                                "type": "string",
                                                "x-kubernetes-validations": [
                                                    {
                                                        "rule": "self == oldSelf",
                                                        "message": "sandbox name is immutable",
                                                    }
                                                ],
                                            }
                                        },
                                    },
                                    "size": {"type": "integer"},
                                },
                            }
                        },
                    }
                },
            }
        ],
    },
}


def widget(name: str, sandbox: str, size: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Widget",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"sandbox": {"name": sandbox}, "size": size},
    }


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    running = Cluster(tmp_path)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def widgets(cluster: Cluster) -> Cluster:
    cluster.apply(WIDGETS)
    cluster.apply(widget("w1", "sbx-a", 1))
    return cluster


IMMUTABLE = (
    'The Widget "w1" is invalid: spec.sandbox.name: Invalid value: "string": '
    "sandbox name is immutable"
)


def test_kubectl_patch_of_an_immutable_field_is_refused_with_the_rules_message(
    widgets: Cluster,
) -> None:
    for patch_type, patch in (
        ("merge", {"spec": {"sandbox": {"name": "sbx-b"}}}),
        ("json", [{"op": "replace", "path": "/spec/sandbox/name", "value": "sbx-b"}]),
    ):
        result = widgets.patch("widget/w1", json.dumps(patch), patch_type=patch_type, check=False)
        assert result.returncode != 0
        assert IMMUTABLE in result.stderr
    widgets.patch("widget/w1", json.dumps({"spec": {"size": 2}}))
    shown = json.loads(widgets.kubectl("get", "widget/w1", "-o", "json").stdout)
    assert shown["spec"] == {"sandbox": {"name": "sbx-a"}, "size": 2}


def test_kubectl_apply_client_and_server_side_is_refused_too(widgets: Cluster) -> None:
    changed = json.dumps(widget("w1", "sbx-b", 1))
    # --force-conflicts: the field was set by a client-side apply, another manager.
    for extra in ([], ["--server-side", "--force-conflicts"]):
        result = widgets.kubectl("apply", *extra, "-f", "-", stdin=changed, check=False)
        assert result.returncode != 0
        assert IMMUTABLE in result.stderr
    resized = json.dumps(widget("w1", "sbx-a", 3))
    widgets.kubectl("apply", "-f", "-", stdin=resized)
    shown = json.loads(widgets.kubectl("get", "widget/w1", "-o", "json").stdout)
    assert shown["spec"] == {"sandbox": {"name": "sbx-a"}, "size": 3}


def test_kubectl_apply_of_a_crd_whose_rule_does_not_compile_is_refused(cluster: Cluster) -> None:
    broken = copy.deepcopy(WIDGETS)
    spec = broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["x-kubernetes-validations"] = [{"rule": "self.size.lowerAscii() == 'a'"}]
    result = cluster.apply(broken, check=False)
    assert result.returncode != 0
    assert f'The CustomResourceDefinition "widgets.{GROUP}" is invalid' in result.stderr
    assert (
        "spec.versions[0].schema.openAPIV3Schema.properties[spec].x-kubernetes-validations[0]"
        ".rule: Invalid value: \"self.size.lowerAscii() == 'a'\": compilation failed"
    ) in result.stderr
    assert "undeclared reference to 'lowerAscii'" in result.stderr
    assert cluster.kubectl("get", "crd", "-o", "name").stdout.strip() == ""


def test_the_calibantask_crd_refuses_a_workspace_ref_without_a_prompt(cluster: Cluster) -> None:
    crd_file = REPO / "orchestrator/operator/crds/calibantask.yaml"
    cluster.kubectl("apply", "-f", str(crd_file))
    definition = yaml.safe_load(crd_file.read_text(encoding="utf-8"))
    group = definition["spec"]["group"]
    version = next(v["name"] for v in definition["spec"]["versions"] if v.get("storage"))

    def task(name: str, spec: dict[str, Any]) -> str:
        body = {"apiVersion": f"{group}/{version}", "kind": "CalibanTask"}
        return json.dumps({**body, "metadata": {"name": name}, "spec": spec})

    bare = task("t1", {"task": {"agents": 1}, "workspaceRef": {"name": "repo"}})
    result = cluster.kubectl("create", "-f", "-", stdin=bare, check=False)
    assert result.returncode != 0
    assert (
        'The CalibanTask "t1" is invalid: spec: Invalid value: "object": spec.task.prompt is '
        "required with a workspaceRef"
    ) in result.stderr
    prompted = task("t1", {"task": {"agents": 1, "prompt": "go"}, "workspaceRef": {"name": "r"}})
    cluster.kubectl("create", "-f", "-", stdin=prompted)
    cleared = cluster.patch(
        "calibantask/t1", json.dumps({"spec": {"task": {"prompt": None}}}), check=False
    )
    assert cleared.returncode != 0
    assert "spec.task.prompt is required with a workspaceRef" in cleared.stderr
