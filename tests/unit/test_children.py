"""The builders of what the operator creates (``orchestrator.operator.children``): the
task's ServiceAccount and NetworkPolicy (caliban-operator's conventions), its drain guard,
the broker Secret, a checkpoint's VolumeSnapshot, and who each says manages it."""

from __future__ import annotations

import pytest

from orchestrator.operator import children, crd, workspace
from orchestrator.settings import Settings

OWNER = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": "t", "uid": "u-1",
         "controller": True, "blockOwnerDeletion": True}  # fmt: skip


@pytest.mark.parametrize(
    ("url", "port"),
    [
        ("redis://127.0.0.1:6379/0", 6379),
        ("redis://:pw@broker:7000/1", 7000),
        ("redis://broker/0", 6379),
        ("amqp://guest:guest@rabbit//", 5672),
        ("amqps://rabbit//", 5671),
        ("amqp://rabbit:5673//", 5673),
    ],
)
def test_the_broker_port_comes_from_the_url(url: str, port: int) -> None:
    assert children.broker_port(url) == port


@pytest.mark.parametrize("url", ["http://broker/", "redis://broker:notaport/0", "memory://"])
def test_a_broker_url_without_a_port_is_refused_in_one_line(url: str) -> None:
    with pytest.raises(ValueError, match="broker URL"):
        children.broker_port(url)


def test_the_service_account_mounts_no_token_and_goes_with_the_task() -> None:
    sa = children.service_account("t", "ns", OWNER)
    assert sa["metadata"]["name"] == "t-sa"
    assert sa["metadata"]["namespace"] == "ns"
    assert sa["metadata"]["ownerReferences"] == [OWNER]
    assert sa["automountServiceAccountToken"] is False


def test_the_network_policy_admits_only_metrics_and_reaches_only_dns_and_the_broker() -> None:
    policy = children.network_policy("t", "ns", OWNER, "redis://:pw@broker:7000/0")
    assert policy["metadata"]["name"] == "t-netpol"
    assert policy["metadata"]["ownerReferences"] == [OWNER]
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {crd.TASK_LABEL: "t"}}
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    monitoring = {"matchLabels": {"caliban.caliban-ai.dev/monitoring": "true"}}
    assert spec["ingress"] == [
        {
            "from": [{"namespaceSelector": monitoring}],
            "ports": [{"protocol": "TCP", "port": crd.DAEMON_METRICS_PORT}],
        }
    ]
    ports = sorted((p["protocol"], p["port"]) for rule in spec["egress"] for p in rule["ports"])
    assert ports == [("TCP", 53), ("TCP", 7000), ("UDP", 53)]
    dns, broker = spec["egress"]
    assert dns["to"] == [children.DNS_PEER]
    assert broker["to"] == [
        {
            "namespaceSelector": {
                "matchLabels": {"caliban.caliban-ai.dev/broker-namespace": "true"}
            },
            "podSelector": {"matchLabels": {"caliban.caliban-ai.dev/broker": "true"}},
        }
    ]
    assert "pw" not in str(policy)


def test_the_network_policys_peers_follow_the_operators_selectors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tried: a monitoring namespace named by its name label, and no broker selectors
    (a broker outside the cluster: its port anywhere)."""
    monkeypatch.setenv(
        "DRAIN_MONITORING_NAMESPACE_SELECTOR", "kubernetes.io/metadata.name=monitoring"
    )
    monkeypatch.setenv("DRAIN_BROKER_NAMESPACE_SELECTOR", "")
    monkeypatch.setenv("DRAIN_BROKER_POD_SELECTOR", "")
    peers = children.NetworkPeers.of(Settings())
    spec = children.network_policy("t", "ns", OWNER, "redis://broker:6379/0", (), peers)["spec"]
    [scrape] = spec["ingress"]
    assert scrape["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    dns, broker = spec["egress"]
    assert dns["to"] == [children.DNS_PEER]
    assert broker == {"ports": [{"protocol": "TCP", "port": 6379}]}


@pytest.mark.parametrize("bad", ["app", "=x", "a b=c", "team=mon itoring", "x=" + "v" * 64])
def test_a_malformed_selector_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv("DRAIN_BROKER_POD_SELECTOR", bad)
    with pytest.raises(ValueError, match=r"DRAIN_BROKER_POD_SELECTOR: .* is not a label key=value"):
        Settings()


def test_a_workspace_task_also_reaches_its_providers_and_remotes_ports() -> None:
    policy = children.network_policy("t", "ns", OWNER, "amqp://broker/", (443, 11434))
    ports = sorted((p["protocol"], p["port"]) for r in policy["spec"]["egress"] for p in r["ports"])
    assert ports == [("TCP", 53), ("TCP", 443), ("TCP", 5672), ("TCP", 11434), ("UDP", 53)]


@pytest.mark.parametrize(
    ("base_url", "repos", "ports"),
    [
        ("http://127.0.0.1:11434/v1", ["file:///srv/a.git", "/srv/b"], (11434,)),
        ("https://llm.example/v1", ["https://git.example/a.git"], (443,)),
        ("http://gw.example/v1", ["git@git.example:team/a.git", "ssh://git.example:2222/a"],
         (22, 80, 2222)),
        ("http://127.0.0.1:8080/v1", ["git://git.example/a", "git+ssh://git.example/a"],
         (22, 8080, 9418)),
    ],
)  # fmt: skip
def test_a_workspaces_egress_ports_are_its_providers_and_its_remotes(
    base_url: str, repos: list[str], ports: tuple[int, ...]
) -> None:
    binding = workspace.Binding(
        workspace="ws", provider="p", kind="openai", model="m", base_url=base_url,
        credentials=None, env=(),
        sources=tuple(workspace.Source(f"s{i}", r, "main", f"/w/{i}") for i, r in enumerate(repos)),
    )  # fmt: skip
    assert workspace.egress_ports(binding) == ports


OURS = {
    "metadata": {"labels": {crd.TASK_LABEL: "t", crd.COMPONENT_LABEL: "daemon"}},
    "spec": {
        "serviceAccountName": "t-sa",
        "automountServiceAccountToken": False,
        "containers": [{"name": "caliband", "image": "ours:1", "args": ["daemon"],
                        "env": [{"name": "DRAIN_LOG_FORMAT", "value": "text"}]}],
        "volumes": [{"name": "workspace", "persistentVolumeClaim": {"claimName": "ws-t"}}],
    },
}  # fmt: skip


@pytest.mark.parametrize(
    ("theirs", "path", "expected"),
    [
        # What the user adds is kept.
        ({"spec": {"nodeSelector": {"pool": "agents"}}}, ("spec", "nodeSelector"),
         {"pool": "agents"}),
        ({"spec": {"tolerations": [{"key": "gpu", "operator": "Exists"}]}},
         ("spec", "tolerations"), [{"key": "gpu", "operator": "Exists"}]),
        ({"metadata": {"labels": {"team": "a"}}}, ("metadata", "labels", "team"), "a"),
        ({"metadata": {"annotations": {"a": "1"}}}, ("metadata", "annotations"), {"a": "1"}),
        ({"spec": {"containers": [{"name": "caliband", "resources": {"limits": {"cpu": "2"}}}]}},
         ("spec", "containers", 0, "resources"), {"limits": {"cpu": "2"}}),
        ({"spec": {"containers": [{"name": "caliband",
                                   "env": [{"name": "HTTPS_PROXY", "value": "x"}]}]}},
         ("spec", "containers", 0, "env"),
         [{"name": "DRAIN_LOG_FORMAT", "value": "text"}, {"name": "HTTPS_PROXY", "value": "x"}]),
        ({"spec": {"containers": [{"name": "sidecar", "image": "s:1"}]}},
         ("spec", "containers", 1), {"name": "sidecar", "image": "s:1"}),
        ({"spec": {"volumes": [{"name": "cache", "emptyDir": {}}]}}, ("spec", "volumes", 1),
         {"name": "cache", "emptyDir": {}}),
        # Where both set a value, ours wins: the drain contract cannot be unset.
        ({"metadata": {"labels": {crd.TASK_LABEL: "other"}}},
         ("metadata", "labels", crd.TASK_LABEL), "t"),
        ({"spec": {"automountServiceAccountToken": True}}, ("spec", "automountServiceAccountToken"),
         False),
        ({"spec": {"serviceAccountName": "admin"}}, ("spec", "serviceAccountName"), "t-sa"),
        ({"spec": {"containers": [{"name": "caliband", "image": "theirs:9", "args": []}]}},
         ("spec", "containers", 0, "image"), "ours:1"),
        ({"spec": {"containers": [{"name": "caliband", "args": ["sh"]}]}},
         ("spec", "containers", 0, "args"), ["daemon"]),
        ({"spec": {"containers": [{"name": "caliband",
                                   "env": [{"name": "DRAIN_LOG_FORMAT", "value": "json"}]}]}},
         ("spec", "containers", 0, "env"), [{"name": "DRAIN_LOG_FORMAT", "value": "text"}]),
        ({"spec": {"volumes": [{"name": "workspace", "emptyDir": {}}]}}, ("spec", "volumes"),
         [{"name": "workspace", "persistentVolumeClaim": {"claimName": "ws-t"}, "emptyDir": {}}]),
        # No template: ours unchanged.
        ({}, (), OURS),
    ],
)  # fmt: skip
def test_the_users_pod_template_goes_under_ours(
    theirs: dict[str, object], path: tuple[str | int, ...], expected: object
) -> None:
    value: object = children.merge_under(OURS, theirs)
    for step in path:
        value = value[step]  # type: ignore[index]
    assert value == expected


def test_the_daemon_container_stays_first_and_ours_is_not_mutated() -> None:
    before = repr(OURS)
    merged = children.merge_under(
        OURS, {"spec": {"containers": [{"name": "sidecar"}, {"name": "caliband", "tty": True}]}}
    )
    assert [c["name"] for c in merged["spec"]["containers"]] == ["caliband", "sidecar"]
    assert merged["spec"]["containers"][0]["tty"] is True
    assert repr(OURS) == before


# ------------------------------------------------------------------- who manages what

TASK = children.TaskRef("ns", "t", "u-1")


def test_the_managed_by_label_is_kubernetes_recommended_one_naming_caliban_drain() -> None:
    assert (crd.MANAGED_BY_LABEL, crd.MANAGED_BY) == (
        "app.kubernetes.io/managed-by",
        "caliban-drain",
    )


@pytest.mark.parametrize(
    ("built", "labels"),
    [
        (children.service_account("t", "ns", OWNER),
         {crd.TASK_LABEL: "t", "app.kubernetes.io/managed-by": "caliban-drain"}),
        (children.network_policy("t", "ns", OWNER, "redis://broker:6379/0"),
         {crd.TASK_LABEL: "t", "app.kubernetes.io/managed-by": "caliban-drain"}),
        (children.workspace_pvc(TASK, "ws-t", "1Gi"),
         {crd.TASK_LABEL: "t", "app.kubernetes.io/managed-by": "caliban-drain"}),
        (children.workspace_pvc(TASK, "ws-t2", "1Gi", from_snapshot="ck-1"),
         {crd.TASK_LABEL: "t", "app.kubernetes.io/managed-by": "caliban-drain"}),
        (children.drain_guard("t", "ns", OWNER),
         {crd.TASK_LABEL: "t", "app.kubernetes.io/managed-by": "caliban-drain"}),
        (children.broker_secret("ns", "caliban-drain-broker", "redis://broker:6379/0"),
         {crd.COMPONENT_LABEL: crd.DAEMON_COMPONENT,
          "app.kubernetes.io/managed-by": "caliban-drain"}),
        (children.workspace_snapshot(TASK, "ck-1", "ws-t", "csi-snapclass"),
         {crd.TASK_LABEL: "t", "app.kubernetes.io/managed-by": "caliban-drain",
          crd.CHECKPOINT_LABEL: "ck-1", crd.TASK_UID_LABEL: "u-1"}),
    ],
    ids=["service-account", "network-policy", "pvc", "restored-pvc", "drain-guard",
         "broker-secret", "volume-snapshot"],
)  # fmt: skip
def test_every_object_the_operator_creates_says_caliban_drain_manages_it(
    built: dict[str, object], labels: dict[str, str]
) -> None:
    metadata = built["metadata"]
    assert isinstance(metadata, dict)
    assert metadata["labels"] == labels


def test_the_drain_guard_holds_the_tasks_pod_and_goes_with_the_task() -> None:
    guard = children.drain_guard("t", "ns", OWNER)
    assert guard["metadata"]["name"] == "t-drain-guard" == children.drain_guard_name("t")
    assert guard["metadata"]["ownerReferences"] == [OWNER]
    assert guard["spec"] == {
        "maxUnavailable": 0,
        "selector": {"matchLabels": {crd.TASK_LABEL: "t"}},
    }


def test_a_checkpoints_snapshot_is_named_by_its_ref_and_owned_by_nobody() -> None:
    snapshot = children.workspace_snapshot(TASK, "ck-1", "ws-t", "csi-snapclass")
    assert (snapshot["metadata"]["name"], snapshot["metadata"]["namespace"]) == ("ck-1", "ns")
    assert "ownerReferences" not in snapshot["metadata"]
    assert snapshot["spec"] == {
        "volumeSnapshotClassName": "csi-snapclass",
        "source": {"persistentVolumeClaimName": "ws-t"},
    }


def test_the_broker_secret_holds_the_url_base64_and_belongs_to_no_task() -> None:
    secret = children.broker_secret("ns", "caliban-drain-broker", "redis://:pw@broker:6379/0")
    assert secret["data"] == {crd.BROKER_SECRET_KEY: "cmVkaXM6Ly86cHdAYnJva2VyOjYzNzkvMA=="}
    assert "ownerReferences" not in secret["metadata"]
    assert crd.TASK_LABEL not in secret["metadata"]["labels"]
