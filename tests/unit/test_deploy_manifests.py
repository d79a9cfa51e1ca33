"""``deploy/`` as kustomize: what ``kubectl kustomize`` renders for each overlay, checked
offline.

- Both overlays render with the real ``kubectl kustomize``.
- Every rendered object is valid against the Kubernetes API's JSON schemas: the
  ``kubernetes-validate`` package from PyPI (it ships the API's OpenAPI turned into JSON
  schemas, per Kubernetes version, inside the wheel: nothing is fetched), strict mode
  (unknown fields refused), for Kubernetes ``KUBERNETES_VERSION`` (1.32, the version of
  the ``kubectl`` these tests run). The samples are valid against the CalibanTask CRD's
  own ``openAPIV3Schema`` as rendered.
- The manifests grant no ``*`` in any RBAC rule, inline no secret (no Secret object, no
  ``stringData``, no literal value for a ``*_URL``/password/token variable: every such
  value comes through a ``secretKeyRef``), give every container requests, limits and
  probes and the image's non-root user, and name only the contract's Secrets (which the
  operations guide documents). Each check is shown to fail on a copy of ``deploy/``
  edited to break it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = ("production", "dev")
KUBERNETES_VERSION = "1.32"
RUN_AS_USER = 10001
"""The Dockerfile's ``USER``."""
CONTRACT_SECRETS = {
    "caliban-drain-broker": {"url"},
    "caliban-drain-result-backend": {"url"},
    "caliban-drain-ledger": {"url"},
    "caliban-drain-flower": {"basic-auth"},
    "caliban-drain-message-key": {"key"},
    "caliban-drain-broker-admin": {"url"},
}
"""Secret name → the keys the manifests read: created by the installer, never here."""
SENSITIVE_ENV = re.compile(r"(_URL|URL_|PASSWORD|TOKEN|SECRET|BASIC_AUTH|_KEY)$|^DRAIN_.*_URL$")
"""Variables whose value may be a credential: they must come from a Secret."""
NOT_SENSITIVE = {"DRAIN_DAEMON_BROKER_SECRET"}
"""Names matching ``SENSITIVE_ENV`` that hold a Secret's *name*, not a value."""
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob", "Pod")

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")


def render(deploy: Path, overlay: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        ["kubectl", "kustomize", str(deploy / "overlays" / overlay)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, f"kubectl kustomize {overlay}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(DEPLOY, str(request.param))


def ident(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{obj.get('kind')} {where}{meta.get('name')}"


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj.get("kind") not in WORKLOADS:
        return None
    spec = obj.get("spec") or {}
    if obj["kind"] == "Pod":
        return spec
    if obj["kind"] == "CronJob":
        spec = (spec.get("jobTemplate") or {}).get("spec") or {}
    result: dict[str, Any] = (spec.get("template") or {}).get("spec") or {}
    return result


def containers(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], bool]]:
    """(what, container, is an init container) of a workload."""
    spec = pod_spec(obj) or {}
    for field, init in (("initContainers", True), ("containers", False)):
        for c in spec.get(field) or []:
            yield f"{ident(obj)} container {c.get('name')}", c, init


def crd_schemas(objs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(group, version, kind) → ``openAPIV3Schema`` of each CRD among ``objs``."""
    return {
        (o["spec"]["group"], v["name"], o["spec"]["names"]["kind"]): v["schema"]["openAPIV3Schema"]
        for o in objs if o["kind"] == "CustomResourceDefinition"
        for v in o["spec"]["versions"]
    }  # fmt: skip


# ------------------------------------------------------------------------- the checks


def wildcard_grants(objs: list[dict[str, Any]]) -> list[str]:
    problems = []
    for obj in objs:
        if obj.get("kind") not in ("Role", "ClusterRole"):
            continue
        for n, rule in enumerate(obj.get("rules") or []):
            for field in ("verbs", "resources", "apiGroups", "nonResourceURLs", "resourceNames"):
                if any("*" in str(v) for v in rule.get(field) or []):
                    problems.append(f"{ident(obj)} rule {n} grants '*' in {field}")
    return problems


def inlined_secrets(objs: list[dict[str, Any]]) -> list[str]:
    problems = []
    for obj in objs:
        if obj.get("kind") == "Secret":
            problems.append(f"{ident(obj)} is in the manifests (its values would be too)")
        if "stringData" in yaml.safe_dump(obj):
            problems.append(f"{ident(obj)} has stringData")
        for what, c, _ in containers(obj):
            for item in c.get("env") or []:
                name = str(item.get("name"))
                if name in NOT_SENSITIVE or not SENSITIVE_ENV.search(name):
                    continue
                if "value" in item or "secretKeyRef" not in (item.get("valueFrom") or {}):
                    problems.append(f"{what}: {name} is not read from a Secret (secretKeyRef)")
    return problems


def unbounded_containers(objs: list[dict[str, Any]]) -> list[str]:
    """Containers without CPU and memory requests and limits, app containers without
    liveness and readiness probes, and any not run as the image's user, unprivileged."""
    problems = []
    for obj in objs:
        spec = pod_spec(obj)
        if spec is None:
            continue
        pod_sc = spec.get("securityContext") or {}
        for what, c, init in containers(obj):
            resources = c.get("resources") or {}
            for kind in ("requests", "limits"):
                missing = {"cpu", "memory"} - set(resources.get(kind) or {})
                if missing:
                    problems.append(f"{what}: no {kind} for {sorted(missing)}")
            if not init:
                problems += [f"{what}: no {p}" for p in ("livenessProbe", "readinessProbe")
                             if p not in c]  # fmt: skip
            sc = {**pod_sc, **(c.get("securityContext") or {})}
            if sc.get("runAsNonRoot") is not True or sc.get("runAsUser") != RUN_AS_USER:
                problems.append(f"{what}: not run as non-root uid {RUN_AS_USER}")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{what}: privilege escalation allowed")
            if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
                problems.append(f"{what}: capabilities not dropped (drop: [ALL])")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{what}: root filesystem writable")
    return problems


def referenced_secrets(objs: list[dict[str, Any]]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for obj in objs:
        for _, c, _ in containers(obj):
            for item in c.get("env") or []:
                ref = (item.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    found.setdefault(ref["name"], set()).add(ref["key"])
    return found


CHECKS: list[Callable[[list[dict[str, Any]]], list[str]]] = [
    wildcard_grants, inlined_secrets, unbounded_containers,
]  # fmt: skip


# ------------------------------------------------------------------- the real manifests


def test_every_rendered_object_is_valid_against_the_kubernetes_api_schemas(
    rendered: list[dict[str, Any]],
) -> None:
    """Built-in kinds against kubernetes-validate's schemas; a custom resource (kopf's
    peering object) against its CRD's ``openAPIV3Schema`` from the same rendering."""
    import kubernetes_validate

    custom = crd_schemas(rendered)
    problems = []
    for obj in rendered:
        group, _, version = obj["apiVersion"].rpartition("/")
        try:
            if (group, version, obj["kind"]) in custom:
                jsonschema.validate(obj, custom[group, version, obj["kind"]])
            else:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            problems.append(f"{ident(obj)}: {'.'.join(map(str, exc.path))}: {exc.message}")
    assert problems == []
    kinds = {obj["kind"] for obj in rendered}
    assert {"Namespace", "CustomResourceDefinition", "Deployment", "Service",
            "PodDisruptionBudget", "NetworkPolicy", "ServiceAccount"} <= kinds  # fmt: skip


def test_the_samples_are_valid_against_the_calibantask_crd_as_rendered(
    rendered: list[dict[str, Any]],
) -> None:
    from orchestrator.operator import crd

    schemas = crd_schemas(rendered)
    samples = sorted((DEPLOY / "samples").glob("*.yaml"))
    assert samples
    for sample in samples:
        task = yaml.safe_load(sample.read_text())
        assert task["apiVersion"] == crd.API_VERSION
        jsonschema.validate(task, schemas[crd.GROUP, crd.VERSION, crd.KIND])


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_rendered_manifests_pass(
    rendered: list[dict[str, Any]], check: Callable[[list[dict[str, Any]]], list[str]]
) -> None:
    assert check(rendered) == []


def test_only_the_contract_secrets_are_read(rendered: list[dict[str, Any]]) -> None:
    assert referenced_secrets(rendered) == CONTRACT_SECRETS


def test_the_operations_guide_names_every_secret_to_create() -> None:
    text = (REPO / "docs" / "operations.md").read_text()
    assert [name for name in CONTRACT_SECRETS if name not in text] == []


def test_production_runs_two_operators_and_migrates_the_ledger_before_the_operator() -> None:
    objs = {ident(o): o for o in render(DEPLOY, "production")}
    operator = objs["Deployment caliban-drain/caliban-drain-operator"]
    assert operator["spec"]["replicas"] == 2
    spec = operator["spec"]["template"]["spec"]
    (migrate,) = spec["initContainers"]
    assert migrate["args"] == ["db", "upgrade"]
    (main,) = spec["containers"]
    assert main["args"] == ["operator", "--manage-sandbox", "--peering", "caliban-drain",
                            "--liveness", "http://$(DRAIN_POD_IP):8080/healthz"]  # fmt: skip
    assert migrate["image"] == main["image"] == "ghcr.io/caliban-ai/caliban-drain:0.1.0"
    env = {e["name"]: e for e in main["env"]}
    assert env["DRAIN_DAEMON_IMAGE"]["value"] == main["image"]
    assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert {p["containerPort"] for p in main["ports"]} == {8080, 9100}


def test_the_daemon_network_policy_lets_daemons_reach_only_the_broker_and_dns(
    rendered: list[dict[str, Any]],
) -> None:
    from orchestrator.operator.crd import COMPONENT_LABEL, DAEMON_COMPONENT

    (policy,) = [
        o for o in rendered if ident(o) == "NetworkPolicy caliban-drain/caliban-drain-daemon"
    ]
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {COMPONENT_LABEL: DAEMON_COMPONENT}}
    assert "Egress" in spec["policyTypes"]
    ports = sorted((p["protocol"], p["port"]) for rule in spec["egress"] for p in rule["ports"])
    assert ports == [("TCP", 53), ("TCP", 5672), ("TCP", 6379), ("UDP", 53)]
    assert all(rule.get("to") for rule in spec["egress"])  # no rule open to everywhere
    assert spec["ingress"] == [{"from": [MONITORING], "ports": [{"protocol": "TCP", "port": 9102}]}]


MONITORING = {"namespaceSelector": {"matchLabels": {"caliban.caliban-ai.dev/monitoring": "true"}}}


def test_the_control_plane_is_reached_only_from_monitoring_and_reaches_only_named_peers(
    rendered: list[dict[str, Any]],
) -> None:
    (policy,) = [
        o for o in rendered if ident(o) == "NetworkPolicy caliban-drain/caliban-drain-control-plane"
    ]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert [rule["from"] for rule in spec["ingress"]] == [[MONITORING]]
    ports = {p["port"] for rule in spec["ingress"] for p in rule["ports"]}
    assert ports == {9100, 9101, 5555}
    # Every egress rule names its destination, but the API server's, which no selector
    # names portably: that one opens its two ports only.
    open_rules = [rule for rule in spec["egress"] if not rule.get("to")]
    assert [sorted(p["port"] for p in rule["ports"]) for rule in open_rules] == [[443, 6443]]
    named = {p["port"] for rule in spec["egress"] if rule.get("to") for p in rule["ports"]}
    assert named == {53, 6379, 5672, 5432}


@pytest.mark.parametrize("deployment", ["caliban-drain-operator", "caliban-drain-worker"])
def test_metrics_and_probes_are_served_on_the_pods_own_address_only(
    rendered: list[dict[str, Any]], deployment: str
) -> None:
    """Not on 0.0.0.0: the pod's IP, from the downward API, defined before the variable
    that refers to it (Kubernetes expands $(VAR) only from variables listed earlier)."""
    (dep,) = [o for o in rendered if ident(o) == f"Deployment caliban-drain/{deployment}"]
    (main,) = dep["spec"]["template"]["spec"]["containers"]
    names = [e["name"] for e in main["env"]]
    env = {e["name"]: e for e in main["env"]}
    assert env["DRAIN_POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["DRAIN_METRICS_HOST"]["value"] == "$(DRAIN_POD_IP)"
    assert names.index("DRAIN_POD_IP") < names.index("DRAIN_METRICS_HOST")
    assert "0.0.0.0" not in json.dumps(main)


# ------------------------------------------------------------------- the checks, failing


@pytest.fixture
def deploy_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    return copy


def _edit_docs(path: Path, edit: Callable[[list[dict[str, Any]]], None]) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    edit(docs)
    path.write_text(yaml.safe_dump_all(docs))


def _grant_wildcard(deploy: Path) -> None:
    def edit(docs: list[dict[str, Any]]) -> None:
        roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole") and d.get("rules")]
        if roles:
            roles[0]["rules"][0]["verbs"] = ["*"]
        else:
            rule = {"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]}
            docs.append({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                         "metadata": {"name": "edited"}, "rules": [rule]})  # fmt: skip

    _edit_docs(deploy / "base" / "rbac.yaml", edit)


def _literal_broker_url(deploy: Path) -> None:
    def edit(docs: list[dict[str, Any]]) -> None:
        (container,) = docs[0]["spec"]["template"]["spec"]["containers"]
        for item in container["env"]:
            if item["name"] == "DRAIN_BROKER_URL":
                item.pop("valueFrom")
                item["value"] = "redis://:hunter2@broker:6379/0"

    _edit_docs(deploy / "base" / "operator.yaml", edit)


def _add_resource(deploy: Path, name: str, obj: dict[str, Any]) -> None:
    (deploy / "base" / name).write_text(yaml.safe_dump(obj))
    kustomization = deploy / "base" / "kustomization.yaml"
    _edit_docs(kustomization, lambda docs: docs[0]["resources"].append(name))


def _secret_with_data(deploy: Path) -> None:
    _add_resource(deploy, "secret.yaml", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "caliban-drain-broker"},
        "data": {"url": "cmVkaXM6Ly86aHVudGVyMkBicm9rZXI6NjM3OS8w"},
    })  # fmt: skip


def _secret_with_string_data(deploy: Path) -> None:
    _add_resource(deploy, "secret.yaml", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "caliban-drain-ledger"},
        "stringData": {"url": "postgresql+psycopg://drain:hunter2@db/ledger"},
    })  # fmt: skip


def _drop_worker_limits(deploy: Path) -> None:
    def edit(docs: list[dict[str, Any]]) -> None:
        (container,) = docs[0]["spec"]["template"]["spec"]["containers"]
        del container["resources"]["limits"]

    _edit_docs(deploy / "base" / "worker.yaml", edit)


@pytest.mark.parametrize(
    ("edit", "check", "expected"),
    [
        (_grant_wildcard, wildcard_grants, "grants '*' in verbs"),
        (_literal_broker_url, inlined_secrets,
         "container operator: DRAIN_BROKER_URL is not read from a Secret"),
        (_secret_with_data, inlined_secrets,
         "Secret caliban-drain/caliban-drain-broker is in the manifests"),
        (_secret_with_string_data, inlined_secrets,
         "Secret caliban-drain/caliban-drain-ledger has stringData"),
        (_drop_worker_limits, unbounded_containers,
         "container worker: no limits for ['cpu', 'memory']"),
    ],
    ids=["rbac-wildcard", "literal-url-env", "secret-data", "secret-stringdata", "no-limits"],
)  # fmt: skip
def test_a_manifest_edited_to_break_a_rule_fails_its_check(
    deploy_copy: Path,
    edit: Callable[[Path], None],
    check: Callable[[list[dict[str, Any]]], list[str]],
    expected: str,
) -> None:
    """Tried: each edit on a copy of deploy/, rendered with kubectl kustomize."""
    assert check(render(deploy_copy, "production")) == []
    edit(deploy_copy)
    problems = check(render(deploy_copy, "production"))
    assert any(expected in p for p in problems), problems
