"""What ``docker-compose.yml``, ``compose.env.example`` and the ``Dockerfile`` promise
(docs/compose.md), read as files: the compose test (``tests/compose``, ``make
compose-test``) runs them for real, this keeps the promises in the plain pytest run."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
PROJECT_SERVICES = ["db-migrate", "kube-api", "sandbox-controller", "worker", "operator",
                    "flower"]  # fmt: skip
SECRETS = ["POSTGRES_PASSWORD", "FLOWER_BASIC_AUTH"]


def example_settings() -> dict[str, str]:
    lines = (ROOT / "compose.env.example").read_text().splitlines()
    pairs = (line.split("=", 1) for line in lines if line and not line.startswith("#"))
    return {name: value for name, value in pairs}


def test_every_service_shares_the_hosts_network_and_restarts() -> None:
    assert {name: s.get("network_mode") for name, s in SERVICES.items()} == dict.fromkeys(
        SERVICES, "host"
    )
    assert {name: s["restart"] for name, s in SERVICES.items()} == {
        "redis": "unless-stopped", "postgres": "unless-stopped", "db-migrate": "on-failure",
        "kube-api": "unless-stopped", "sandbox-controller": "unless-stopped",
        "worker": "unless-stopped", "operator": "unless-stopped", "flower": "unless-stopped",
    }  # fmt: skip


def test_every_long_running_service_has_a_healthcheck() -> None:
    checked = sorted(name for name, s in SERVICES.items() if "healthcheck" in s)
    assert checked == ["flower", "kube-api", "operator", "postgres", "redis",
                       "sandbox-controller", "worker"]  # fmt: skip


def test_start_order_waits_on_health_and_on_the_migration() -> None:
    waits = {
        name: {dep: spec["condition"] for dep, spec in (s.get("depends_on") or {}).items()}
        for name, s in SERVICES.items()
    }
    assert waits == {
        "redis": {},
        "postgres": {},
        "db-migrate": {"postgres": "service_healthy"},
        "kube-api": {},
        "sandbox-controller": {"kube-api": "service_healthy", "redis": "service_healthy"},
        "worker": {"redis": "service_healthy",
                   "db-migrate": "service_completed_successfully"},
        "operator": {"db-migrate": "service_completed_successfully",
                     "sandbox-controller": "service_healthy", "worker": "service_healthy"},
        "flower": {"redis": "service_healthy"},
    }  # fmt: skip


def test_the_project_services_run_one_image_as_the_configured_user() -> None:
    assert {SERVICES[name]["image"] for name in PROJECT_SERVICES} == {
        "${DRAIN_IMAGE:-ghcr.io/caliban-ai/caliban-drain:latest}"
    }
    assert {SERVICES[name]["user"] for name in PROJECT_SERVICES} == {
        "${DRAIN_UID:-10001}:${DRAIN_GID:-10001}"
    }


def test_servers_listen_on_loopback_only() -> None:
    assert "127.0.0.1" in SERVICES["redis"]["command"]
    assert "listen_addresses=127.0.0.1" in SERVICES["postgres"]["command"]
    flower = SERVICES["flower"]["command"]
    assert flower[flower.index("--address") + 1] == "127.0.0.1"


def test_secrets_come_from_the_environment_and_the_example_sets_none() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    for name in SECRETS:
        values = re.findall(rf"\b{name}: (.*)", text)
        assert values, name
        assert all(v.startswith(f"${{{name}:?") for v in values), values
    assert "${POSTGRES_PASSWORD:?" in SERVICES["worker"]["environment"]["DRAIN_DATABASE_URL"]
    example = example_settings()
    assert {name: example[name] for name in SECRETS} == dict.fromkeys(SECRETS, "")


def test_only_the_ledgers_users_get_its_url() -> None:
    with_ledger = sorted(
        name for name in PROJECT_SERVICES if "DRAIN_DATABASE_URL" in SERVICES[name]["environment"]
    )
    assert with_ledger == ["db-migrate", "operator", "worker"]


def test_the_example_env_file_names_every_variable_the_compose_file_reads() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    read = set(re.findall(r"\$\{([A-Z_]+)", text)) - {"REDIS_IMAGE", "POSTGRES_IMAGE"}
    assert sorted(read - set(example_settings())) == []


def test_the_dockerfile_builds_from_a_slim_python_and_runs_unprivileged() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim-bookworm" in dockerfile
    assert "ARG WHEELHOUSE=" in dockerfile
    assert dockerfile.count("FROM ${BASE_IMAGE}") == 2  # the builder and the runtime
    assert re.findall(r"^USER (.*)$", dockerfile, re.MULTILINE) == ["10001:10001"]
    assert 'ENTRYPOINT ["drainctl"]' in dockerfile
