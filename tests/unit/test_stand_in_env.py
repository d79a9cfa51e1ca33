"""The stand-in Sandbox controller resolves a container's ``env`` as kubelet does:
literal values, and ``secretKeyRef`` from the namespace's Secrets (``data`` base64,
``stringData`` as given, ``stringData`` winning); a missing Secret or key is a
``CreateContainerConfigError`` naming it, never a value."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from orchestrator.devcluster.sandbox_controller import (
    ContainerConfigError,
    container_env,
    secret_values,
)

URL = "redis://drain:hunter2@broker:6379/0"
STORED = {
    ("team-a", "caliban-drain-broker"): secret_values(
        {"data": {"url": base64.b64encode(URL.encode()).decode()}}
    ),
    ("team-a", "plain"): secret_values({"stringData": {"token": "t0ken"}}),
}


def read(namespace: str, name: str) -> dict[str, str] | None:
    return STORED.get((namespace, name))


def ref(name: str, key: str, **extra: Any) -> dict[str, Any]:
    return {"valueFrom": {"secretKeyRef": {"name": name, "key": key, **extra}}}


def test_literal_values_and_secret_refs_from_data_and_string_data() -> None:
    container = {"env": [
        {"name": "LITERAL", "value": "1"},
        {"name": "DRAIN_BROKER_URL", **ref("caliban-drain-broker", "url")},
        {"name": "TOKEN", **ref("plain", "token")},
        {"name": "FIELD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]}  # fmt: skip
    assert container_env("team-a", container, read) == {
        "LITERAL": "1", "DRAIN_BROKER_URL": URL, "TOKEN": "t0ken",
    }  # fmt: skip


def test_string_data_wins_over_data_as_the_api_merges_it() -> None:
    both = {"data": {"k": base64.b64encode(b"old").decode()}, "stringData": {"k": "new"}}
    assert secret_values(both) == {"k": "new"}


@pytest.mark.parametrize(
    ("namespace", "name", "key", "message"),
    [
        ("team-b", "caliban-drain-broker", "url", 'secret "caliban-drain-broker" not found'),
        ("team-a", "caliban-drain-broker", "password",
         "couldn't find key password in Secret team-a/caliban-drain-broker"),
    ],
    ids=["secret-missing", "key-missing"],
)  # fmt: skip
def test_a_missing_secret_or_key_is_a_config_error_without_values(
    namespace: str, name: str, key: str, message: str
) -> None:
    container = {"env": [{"name": "DRAIN_BROKER_URL", **ref(name, key)}]}
    with pytest.raises(ContainerConfigError) as caught:
        container_env(namespace, container, read)
    assert str(caught.value) == message
    assert "hunter2" not in str(caught.value)


def test_an_optional_ref_to_a_missing_secret_is_left_out() -> None:
    container = {"env": [{"name": "X", **ref("absent", "url", optional=True)}]}
    assert container_env("team-a", container, read) == {}
