"""A task author gets agents in a sandbox, not a pod of their choosing: what
``spec.sandbox.podTemplate`` may carry is an allow-list, the pod and every container the
operator writes run restricted, and the daemon image comes from the operator's list.

What was tried: each hostile podTemplate a security review wrote (host namespaces, a
node name, a toleration of every taint, root, a hostPath of ``/`` mounted into the
daemon, a privileged container with SYS_ADMIN, an extra container, a Secret volume, env
from any Secret, a projected service-account token, security annotations and our own
labels) is refused by ``parse_spec`` naming the field, and pruned or refused by the CRD's
schema as the API server applies it; an image not on ``DRAIN_ALLOWED_IMAGES`` is refused.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from orchestrator.devcluster import schema
from orchestrator.operator import crd
from orchestrator.operator.children import PodSettings, TaskRef, pod_template_hash, sandbox
from orchestrator.operator.lifecycle import SpecError, TaskSpec, admit_spec, parse_spec
from orchestrator.operator.workspace import resolve
from orchestrator.settings import Settings
from tests.unit.test_crd_schema import CRD_PATH, load_yaml, openapi_schema

TASK: dict[str, Any] = {
    "apiVersion": crd.API_VERSION,
    "kind": crd.KIND,
    "metadata": {"name": "demo", "namespace": "team-a", "uid": "6f1c2f5e-0d7a-4f7e-9d61"},
    "spec": {"task": {"agents": 2, "provider": "scripted"}},
}

HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("host-network", {"spec": {"hostNetwork": True}}, "sandbox.podTemplate.spec.hostNetwork"),
    ("host-pid", {"spec": {"hostPID": True}}, "sandbox.podTemplate.spec.hostPID"),
    ("host-ipc", {"spec": {"hostIPC": True}}, "sandbox.podTemplate.spec.hostIPC"),
    ("node-name", {"spec": {"nodeName": "control-plane-1"}}, "sandbox.podTemplate.spec.nodeName"),
    ("every-taint", {"spec": {"tolerations": [{"operator": "Exists"}]}},
     "sandbox.podTemplate.spec.tolerations[0].key"),
    ("root", {"spec": {"securityContext": {"runAsUser": 0}}},
     "sandbox.podTemplate.spec.securityContext"),
    ("host-path", {"spec": {
        "volumes": [{"name": "root", "hostPath": {"path": "/"}}],
        "containers": [{"name": "caliband",
                        "volumeMounts": [{"name": "root", "mountPath": "/host"}]}]}},
     "sandbox.podTemplate.spec.volumes"),
    ("privileged", {"spec": {"containers": [{
        "name": "caliband",
        "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}}]}},
     "sandbox.podTemplate.spec.containers[0].securityContext"),
    ("extra-container", {"spec": {"containers": [{"name": "miner", "image": "evil:latest"}]}},
     "sandbox.podTemplate.spec.containers[0].name"),
    ("secret-volume", {"spec": {"volumes": [{"name": "s", "secret": {"secretName": "x"}}]}},
     "sandbox.podTemplate.spec.volumes"),
    ("env-from-secret", {"spec": {"containers": [{
        "name": "caliband", "envFrom": [{"secretRef": {"name": "caliban-drain-broker"}}]}]}},
     "sandbox.podTemplate.spec.containers[0].envFrom"),
    ("value-from-secret", {"spec": {"containers": [{"name": "caliband", "env": [
        {"name": "K", "valueFrom": {"secretKeyRef": {"name": "other", "key": "k"}}}]}]}},
     "sandbox.podTemplate.spec.containers[0].env"),
    ("projected-token", {"spec": {"volumes": [{"name": "t", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token"}}]}}]}}, "sandbox.podTemplate.spec.volumes"),
    ("token-automount", {"spec": {"automountServiceAccountToken": True}},
     "sandbox.podTemplate.spec.automountServiceAccountToken"),
    ("service-account", {"spec": {"serviceAccountName": "admin"}},
     "sandbox.podTemplate.spec.serviceAccountName"),
    ("apparmor-unconfined", {"metadata": {"annotations": {
        "container.apparmor.security.beta.kubernetes.io/caliband": "unconfined"}}},
     "sandbox.podTemplate.metadata.annotations"),
    ("our-label", {"metadata": {"labels": {crd.TASK_LABEL: "another-task"}}},
     "sandbox.podTemplate.metadata.labels"),
]  # fmt: skip

ALLOWED: dict[str, Any] = {
    "metadata": {"labels": {"team": "a"}, "annotations": {"cost-centre": "42"}},
    "spec": {
        "nodeSelector": {"pool": "agents"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        "tolerations": [{"key": "agents", "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [{"name": "caliband",
                        "resources": {"limits": {"memory": "2Gi", "cpu": 2},
                                      "requests": {"cpu": "500m"}}}],
    },
}  # fmt: skip


def our_crd() -> dict[str, Any]:
    return load_yaml(CRD_PATH)


WORKSPACE: dict[str, Any] = {
    "apiVersion": crd.API_VERSION, "kind": crd.WORKSPACE_KIND, "metadata": {"name": "ws"},
    "spec": {
        "sources": [{"name": "app", "repo": "file:///srv/app.git", "path": "/work/app"}],
        "providers": [{"name": "gateway", "kind": "openai", "model": "gpt-local",
                       "baseUrl": "http://127.0.0.1:8080/v1",
                       "credentialsRef": {"secretName": "gateway-key", "key": "k"}}],
    },
}  # fmt: skip


def task_spec(template: dict[str, Any], **task: Any) -> dict[str, Any]:
    return {"task": {"agents": 2, "provider": "scripted", **task},
            "sandbox": {"podTemplate": copy.deepcopy(template)}}  # fmt: skip


def sandbox_of(spec: TaskSpec) -> dict[str, Any]:
    pod = PodSettings.of(Settings(broker_url="redis://127.0.0.1:6379/0"))
    task = TaskRef("team-a", "demo", "6f1c2f5e-0d7a-4f7e-9d61")
    return sandbox(task, spec.with_sandbox_api_version(crd.SANDBOX_V1BETA1), "ws", pod)


@pytest.mark.parametrize(("template", "field"), [(t, f) for _, t, f in HOSTILE],
                         ids=[i for i, _, _ in HOSTILE])  # fmt: skip
def test_a_hostile_pod_template_is_refused_naming_the_field(
    template: dict[str, Any], field: str
) -> None:
    with pytest.raises(SpecError) as refused:
        parse_spec(task_spec(template))
    assert refused.value.field == field
    assert str(refused.value).startswith(f"spec.{field}: ")


OPERATOR_REFUSES = {"apparmor-unconfined", "our-label"}
"""Keys of a map no structural schema can tell apart: the operator refuses them (above),
with the ``SpecValid=False`` condition naming the field."""
SCHEMA_REFUSES = [(i, t, f) for i, t, f in HOSTILE if i not in OPERATOR_REFUSES]


@pytest.mark.parametrize(("template", "field"), [(t, f) for _, t, f in SCHEMA_REFUSES],
                         ids=[i for i, _, _ in SCHEMA_REFUSES])  # fmt: skip
def test_the_crd_schema_lets_no_hostile_field_through(template: dict[str, Any], field: str) -> None:
    """As the API server applies our CRD's schema: the field is unknown (pruned, or
    refused under kubectl's strict field validation) or invalid."""
    body = {**TASK, "spec": task_spec(template)}
    openapi = openapi_schema(our_crd(), crd.VERSION)
    pruned, unknown = schema.prune_and_default(copy.deepcopy(body), openapi)
    errors = schema.validate(pruned, openapi)
    assert unknown or errors, f"{field} passed the schema"
    if not errors:  # pruned: what is left is an empty pod template, and its pod is ours
        plain = sandbox_of(parse_spec(task_spec({})))
        assert sandbox_of(parse_spec(pruned["spec"])) == plain


def test_what_the_allow_list_takes_reaches_the_pod_and_ours_still_wins() -> None:
    body = {**TASK, "spec": task_spec(ALLOWED)}
    openapi = openapi_schema(our_crd(), crd.VERSION)
    pruned, unknown = schema.prune_and_default(copy.deepcopy(body), openapi)
    assert unknown == [] and schema.validate(pruned, openapi) == []
    assert pruned["spec"]["sandbox"]["podTemplate"] == ALLOWED
    pod = sandbox_of(parse_spec(pruned["spec"]))["spec"]["podTemplate"]
    assert pod["metadata"]["labels"]["team"] == "a"
    assert pod["metadata"]["labels"][crd.TASK_LABEL] == "demo"
    assert pod["metadata"]["annotations"] == {
        "cost-centre": "42",
        crd.POD_TEMPLATE_ANNOTATION: pod_template_hash(pod),
    }
    assert pod["spec"]["nodeSelector"] == {"pool": "agents"}
    assert pod["spec"]["affinity"] == ALLOWED["spec"]["affinity"]
    assert pod["spec"]["tolerations"] == ALLOWED["spec"]["tolerations"]
    [daemon] = pod["spec"]["containers"]
    assert daemon["resources"] == ALLOWED["spec"]["containers"][0]["resources"]
    assert daemon["command"] == ["drainctl"]


RESTRICTED_POD = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
}


def test_the_pod_and_every_container_run_restricted() -> None:
    spec = parse_spec({"workspaceRef": {"name": "ws"}, "providerRef": "gateway",
                       "task": {"prompt": "refactor"}})  # fmt: skip
    bound = spec.with_sandbox_api_version(crd.SANDBOX_V1BETA1).with_binding(
        resolve(WORKSPACE, "ws", "gateway", "")
    )
    pod = sandbox_of(bound)["spec"]["podTemplate"]["spec"]
    assert {k: pod["securityContext"][k] for k in RESTRICTED_POD} == RESTRICTED_POD
    assert pod["automountServiceAccountToken"] is False
    containers = [*pod["initContainers"], *pod["containers"]]
    assert len(containers) == 2
    for container in containers:
        assert container["securityContext"] == RESTRICTED_CONTAINER, container["name"]
        # A read-only root: what writes goes to a volume of its own.
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    kinds = {next(k for k in v if k != "name") for v in pod["volumes"]}
    assert kinds <= {"persistentVolumeClaim", "emptyDir"}, kinds


def test_an_image_not_on_the_allow_list_is_refused_naming_the_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = Settings(broker_url="redis://127.0.0.1:6379/0")

    def admit(spec: dict[str, Any], settings: Settings) -> TaskSpec:
        return admit_spec(spec, "demo", images=settings.runnable_images,
                          existing_sandboxes=settings.existing_sandboxes)  # fmt: skip

    with pytest.raises(SpecError) as refused:
        admit(task_spec({}, image="evil:latest"), settings)
    assert refused.value.field == "task.image"
    assert str(refused.value) == (
        "spec.task.image: evil:latest is not an image this operator runs (DRAIN_ALLOWED_IMAGES: "
        f"{settings.daemon_image})"
    )
    # The operator's own image is allowed by default; another is allowed once listed.
    assert (
        admit(task_spec({}, image=settings.daemon_image), settings).image == settings.daemon_image
    )
    monkeypatch.setenv("DRAIN_ALLOWED_IMAGES", "registry.local/caliban:1, evil:latest")
    listed = Settings(broker_url="redis://127.0.0.1:6379/0")
    assert listed.allowed_images == ("registry.local/caliban:1", "evil:latest")
    assert admit(task_spec({}, image="evil:latest"), listed).image == "evil:latest"
