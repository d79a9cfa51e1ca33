"""The names, passwords, URLs and RabbitMQ permissions of per-tenant broker users
(``broker_tenants``), apart from any broker; the brokers themselves enforce them in
``tests/integration/test_broker_tenants.py``."""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

import pytest

from orchestrator.broker_tenants import (
    password,
    rabbitmq_permissions,
    redis_rules,
    user_name,
    with_credentials,
)
from worker_agent.contract import (
    ORCHESTRATOR_QUEUE,
    TENANT_USER_PREFIX,
    daemon_unacked_keys,
    is_tenant_url,
)

KEY, OTHER_KEY = b"k" * 32, b"o" * 32


def test_a_tenant_is_named_after_its_namespace_and_the_key() -> None:
    name = user_name(KEY, "team-a")
    assert re.fullmatch(rf"{re.escape(TENANT_USER_PREFIX)}team-a\.[0-9a-f]{{8}}", name)
    assert user_name(KEY, "team-a") == name  # every replica makes the same user
    assert user_name(OTHER_KEY, "team-a") != name  # another stack on the same broker
    assert password(KEY, "team-a") != password(KEY, "team-b")
    assert password(KEY, "team-a") != password(OTHER_KEY, "team-a")
    assert len(password(KEY, "team-a")) == 64


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://:old@redis.broker:6379/2", "redis://USER:PW@redis.broker:6379/2"),
        ("redis://127.0.0.1/0", "redis://USER:PW@127.0.0.1/0"),
        ("amqp://guest:guest@[::1]:5672/tenant", "amqp://USER:PW@[::1]:5672/tenant"),
        ("rediss://admin:x@r.example:6380/0?ssl_cert_reqs=required",
         "rediss://USER:PW@r.example:6380/0?ssl_cert_reqs=required"),
    ],
)  # fmt: skip
def test_a_tenants_url_is_the_daemons_url_with_its_own_credentials(url: str, expected: str) -> None:
    assert with_credentials(url, "USER", "PW") == expected


def test_a_tenants_url_quotes_what_a_url_cannot_hold_and_says_it_is_a_tenants() -> None:
    url = with_credentials("redis://127.0.0.1:6379/0", f"{TENANT_USER_PREFIX}ns.ab", "p@ss:/")
    parts = urlsplit(url)
    assert unquote(parts.username or "") == f"{TENANT_USER_PREFIX}ns.ab"
    assert unquote(parts.password or "") == "p@ss:/"
    assert is_tenant_url(url)
    assert not is_tenant_url("redis://admin:pw@127.0.0.1:6379/0")
    assert not is_tenant_url("redis://127.0.0.1:6379/0")


def test_the_redis_rules_store_only_a_hash_and_name_only_the_tenants_own_keys() -> None:
    rules = redis_rules("team-a", "secret-password")
    assert "secret-password" not in " ".join(rules)
    assert rules[:2] == ["reset", "on"] and rules[2].startswith("#")
    full_access = [r[1:] for r in rules if r.startswith("~")]
    assert all(
        pattern.startswith(("caliband.team-a.", "_kombu.binding.caliband.team-a.",
                            "_kombu.binding_permanent.caliband.team-a.", "celery-task-meta-"))
        for pattern in full_access
    ), full_access  # fmt: skip
    unacked = daemon_unacked_keys("team-a").values()
    assert all(key.startswith("caliband.team-a._") for key in unacked)
    assert f"%W~{ORCHESTRATOR_QUEUE}" in rules
    assert {"-@pubsub", "+publish", "-keys", "-scan", "-@dangerous", "-@admin"} <= set(rules)


@pytest.mark.parametrize(
    ("right", "resource", "allowed"),
    [
        ("read", "caliband.team-a.work", True),
        ("read", "caliband.team-a.x.y", True),
        ("read", "caliband.team-ab.work", False),
        ("read", "caliband.team-b.work", False),
        ("read", ORCHESTRATOR_QUEUE, False),
        ("read", "celeryev", False),
        ("write", ORCHESTRATOR_QUEUE, True),
        ("write", "celeryev", True),
        ("write", "caliband.team-a.work", True),
        ("write", "caliband.team-b.work", False),
        ("write", "amq.default", False),
        ("write", "", False),
        ("write", "celery.pidbox", False),
        ("configure", "caliband.team-a.work", True),
        ("configure", ORCHESTRATOR_QUEUE, False),
        ("configure", "caliband.team-b.work", False),
        ("configure", "celeryev", True),
    ],
)
def test_the_rabbitmq_permissions_name_the_tenants_own_resources_only(
    right: str, resource: str, allowed: bool
) -> None:
    pattern = rabbitmq_permissions("team-a")[right]
    assert (re.search(pattern, resource) is not None) is allowed
