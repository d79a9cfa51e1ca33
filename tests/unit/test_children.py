"""The task's ServiceAccount and NetworkPolicy builders (caliban-operator's conventions)."""

from __future__ import annotations

import pytest

from orchestrator.operator import children, crd

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
    assert spec["ingress"] == [{"ports": [{"protocol": "TCP", "port": crd.DAEMON_METRICS_PORT}]}]
    ports = sorted((p["protocol"], p["port"]) for rule in spec["egress"] for p in rule["ports"])
    assert ports == [("TCP", 53), ("TCP", 7000), ("UDP", 53)]
    assert "pw" not in str(policy)
