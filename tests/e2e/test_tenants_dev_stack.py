"""Per-tenant broker users on the dev stack, with the real kubectl: ``drainctl dev up`` on a
real Redis with ``DRAIN_BROKER_ADMIN_URL`` set. Each task namespace's Secret holds its
own user's URL, which is all its pod holds (not the admin URL, the message key or the
stack's result backend); its tasks run and drain on it; and one namespace's user is
refused another's queue."""

from __future__ import annotations

import base64
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import psutil
import pytest

from orchestrator.ledger import OperationKind, OperationState
from tests.e2e.support import DevStack, task_manifest
from tests.pipeline_support import fresh_postgres, redis_db_url
from tests.support import wait_until
from worker_agent.contract import TENANT_USER_PREFIX

pytestmark = pytest.mark.slow

NAMESPACES = ("team-a", "team-b")


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    import redis

    url = redis_db_url(db=13)
    root = Path(tempfile.mkdtemp(prefix="cd-tenants-", dir="/tmp"))
    dev = DevStack(root, url, fresh_postgres(), env={"DRAIN_BROKER_ADMIN_URL": url})
    try:
        for namespace in NAMESPACES:
            dev.kubectl("create", "namespace", namespace)
        yield dev
        assert dev.ledger_contradictions() == []
        assert dev.audit_findings() == []
    finally:
        dev.close()
        with redis.Redis.from_url(url) as admin:
            for user in admin.acl_users():
                if user.startswith(tuple(f"{TENANT_USER_PREFIX}{n}." for n in NAMESPACES)):
                    admin.acl_deluser(user)


def secret_url(stack: DevStack, namespace: str) -> str:
    secret = json.loads(
        stack.kubectl("get", "secret", "caliban-drain-broker", "-n", namespace, "-o", "json").stdout
    )
    return base64.b64decode(secret["data"]["url"]).decode()


def test_each_namespaces_pod_holds_its_own_broker_user_and_drains_on_it(
    stack: DevStack,
) -> None:
    import redis
    from redis.exceptions import NoPermissionError

    for namespace in NAMESPACES:
        manifest = task_manifest("work", namespace=namespace, agents=1,
                                 model="turns=100000,turn_ms=200")  # fmt: skip
        assert stack.apply(manifest).returncode == 0
    for namespace in NAMESPACES:
        stack.wait_phase(namespace, "work", "Running", timeout=120)

    urls = {namespace: secret_url(stack, namespace) for namespace in NAMESPACES}
    users = {namespace: unquote(urlsplit(url).username or "") for namespace, url in urls.items()}
    for namespace, user in users.items():
        assert user.startswith(f"{TENANT_USER_PREFIX}{namespace}."), user
    assert urls["team-a"] != urls["team-b"]

    # The pod's processes hold their namespace's user, and nothing of the control plane's.
    pvc = stack.pvc_of("work", namespace="team-a")
    pids = stack.daemon_pids(pvc, namespace="team-a")
    assert pids
    for pid in pids:
        held = psutil.Process(pid).environ()
        assert unquote(urlsplit(held["DRAIN_BROKER_URL"]).username or "") == users["team-a"]
        for control_plane_only in ("DRAIN_BROKER_ADMIN_URL", "DRAIN_MESSAGE_KEY"):
            assert control_plane_only not in held, (pid, control_plane_only)
        backend = held.get("DRAIN_RESULT_BACKEND", held["DRAIN_BROKER_URL"])
        assert backend == held["DRAIN_BROKER_URL"]

    # B's user cannot touch A's queue.
    with redis.Redis.from_url(urls["team-b"]) as b:
        with pytest.raises(NoPermissionError):
            b.lrange("caliband.team-a.work", 0, -1)
        with pytest.raises(NoPermissionError):
            b.delete("caliband.team-a.work")

    # A's task drains on its own user: deleted, recorded, gone.
    task = stack.task("team-a", "work")
    assert task is not None
    uid = task["metadata"]["uid"]
    stack.kubectl("delete", "ctask", "work", "-n", "team-a", "--wait=false")
    wait_until(lambda: stack.task("team-a", "work") is None, 120, "team-a/work gone")
    [op] = [o for o in stack.ledger.list_operations(namespace="team-a", name="work")
            if o.kind is OperationKind.DELETE_DRAIN]  # fmt: skip
    assert op.state is OperationState.RECORDED, op
    assert op.task_uid == uid
    [checkpoint] = stack.ledger.list_checkpoints(namespace="team-a", name="work")
    assert checkpoint.agents and all(agent.turns > 0 for agent in checkpoint.agents)
