"""``docker-compose.yml`` run for real: the images the repository's Dockerfile builds, the
published compose file (with ``docker-compose.test.yml``'s images built from Debian's
packages), ``docker-compose`` bringing it up, the real ``kubectl`` driving it through the
kubeconfig the stack writes to a host folder, the ledger read from PostgreSQL and
Flower's HTTP API checked with its login.

Every container shares the host's network on ports the machine's own servers do not use
(Redis 16379, PostgreSQL 15432, the API 16443, Flower 15555); nothing leaves 127.0.0.1.
Run by ``make compose-test`` (``scripts/docker-engine.sh`` provides the engine), kept out
of the plain ``pytest`` run by the ``compose`` marker.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from base64 import b64decode, b64encode
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import yaml

from tests.compose import images
from worker_agent.contract import ORCHESTRATOR_QUEUE, TENANT_USER_PREFIX
from worker_agent.testing import wait_until

pytestmark = [pytest.mark.compose, pytest.mark.timeout(480)]

PROJECT = "caliban-drain-compose-test"
PORTS = {"REDIS_PORT": 16379, "POSTGRES_PORT": 15432, "KUBE_API_PORT": 16443,
         "FLOWER_PORT": 15555}  # fmt: skip
IMAGE_UID = 10001
"""The image's user, as the Dockerfile creates it: the stack runs as it, so the kubeconfig
folder is made its own (the test, as root, reads it all the same)."""
LONG_RUNNING = ("redis", "postgres", "kube-api", "sandbox-controller", "worker", "operator",
                "flower")  # fmt: skip
POSTGRES_INIT_DELAY_SECS = 15
"""The fault: PostgreSQL's first start initialises for this long before it answers."""

TURNS = """
import json, sys
from pathlib import Path
from worker_agent import layout
from worker_agent.session import load_session, message_text
agents = layout.agents_dir(Path(sys.argv[1]))
found = {}
for d in sorted(agents.iterdir()) if agents.is_dir() else []:
    if layout.session_file(d).exists():
        session = load_session(d)
        found[d.name] = {"turns": session.turns,
                         "user_turns": [
                             int(message_text(m).removeprefix("scripted prompt "))
                             for m in session.messages if m["role"] == "user"]}
print(json.dumps(found))
"""
"""Run in the stand-in controller's container, where the workspaces are: each agent's
completed turns and the turn numbers of its user messages."""


class ComposeStack:
    def __init__(self, root: Path, app_image: str, services_image: str) -> None:
        self.root = root
        self.app_image = app_image
        self.kube_dir = root / "kube"
        self.kube_dir.mkdir()
        shutil.chown(self.kube_dir, IMAGE_UID, IMAGE_UID)
        self.kubeconfig = self.kube_dir / "kubeconfig.yaml"
        self.flower_login = f"tester:{secrets.token_urlsafe(12)}"
        self.env_file = root / "compose.env"
        settings = {
            "POSTGRES_PASSWORD": secrets.token_urlsafe(16),
            "FLOWER_BASIC_AUTH": self.flower_login,
            "DRAIN_MESSAGE_KEY": secrets.token_hex(32),
            "REDIS_PASSWORD": secrets.token_urlsafe(16),
            "DRAIN_UID": IMAGE_UID, "DRAIN_GID": IMAGE_UID,
            "KUBE_DIR": self.kube_dir,
            "DRAIN_IMAGE": app_image,
            "TEST_SERVICES_IMAGE": services_image,
            "POSTGRES_INIT_DELAY_SECS": POSTGRES_INIT_DELAY_SECS,
            **PORTS,
        }  # fmt: skip
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))

    def compose_argv(self, *args: str) -> list[str]:
        return [
            "docker-compose", "--env-file", str(self.env_file), "--project-name", PROJECT,
            "--project-directory", str(images.ROOT),
            "-f", str(images.ROOT / "docker-compose.yml"),
            "-f", str(images.ROOT / "tests" / "compose" / "docker-compose.test.yml"), *args,
        ]  # fmt: skip

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        result = subprocess.run(self.compose_argv(*args), capture_output=True, text=True,
                                timeout=timeout, check=False)  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)}: {result.stderr[-3000:]}")
        return result.stdout

    def exec_in(self, service: str, *argv: str) -> str:
        return self.compose("exec", "-T", service, *argv, timeout=120)

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        result = subprocess.run(
            ["kubectl", "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True, text=True, timeout=120, input=stdin, check=False,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr}")
        return result.stdout

    def containers(self) -> dict[str, dict[str, Any]]:
        """Each service's container as ``docker inspect`` shows it."""
        ids = self.compose("ps", "-q").split()
        if not ids:
            return {}
        shown = subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True,
                               check=True)  # fmt: skip
        inspected: list[dict[str, Any]] = json.loads(shown.stdout)
        return {c["Config"]["Labels"]["com.docker.compose.service"]: c for c in inspected}

    def health(self) -> dict[str, str]:
        """Each service's health ("healthy", …), or its state where it has no check."""
        return {
            name: (c["State"].get("Health") or {}).get("Status") or c["State"]["Status"]
            for name, c in self.containers().items()
        }

    def restart_counts(self) -> dict[str, int]:
        return {name: int(c["RestartCount"]) for name, c in self.containers().items()}

    def all_healthy(self) -> bool:
        health = self.health()
        return all(health.get(name) == "healthy" for name in LONG_RUNNING)

    def up(self) -> None:
        """The whole stack up and healthy (at once where an earlier test left it so)."""
        self.compose("up", "-d", "--no-build", timeout=400)
        wait_until(self.all_healthy, 180, f"every service healthy (now {self.health()})")

    def assert_settled(self, window: float = 10) -> None:
        """No service restarts any more: the counts hold over ``window`` seconds, with
        every service healthy at the end."""
        counts = self.restart_counts()
        time.sleep(window)  # a restart loop shows only as a count that moves: watched
        assert self.restart_counts() == counts
        assert self.all_healthy(), self.health()

    def task_status(self, name: str) -> dict[str, Any]:
        got = self.kubectl("get", "ctask", name, "-o", "json", check=False)
        return dict(json.loads(got).get("status") or {}) if got else {}

    def wait_phase(self, name: str, phase: str, timeout: float = 120) -> dict[str, Any]:
        found = wait_until(lambda: (s := self.task_status(name)).get("phase") == phase and s,
                           timeout, f"{name} to reach phase {phase}")  # fmt: skip
        return dict(found)

    def agents_on_disk(self, pvc: str) -> dict[str, dict[str, Any]]:
        volume = f"/var/lib/caliban-drain/sandboxes/volumes/default/{pvc}"
        found: dict[str, dict[str, Any]] = json.loads(
            self.exec_in("sandbox-controller", "python3", "-c", TURNS, volume)
        )
        return found

    def flower_tasks(self) -> dict[str, dict[str, Any]]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{PORTS['FLOWER_PORT']}/api/tasks",
            headers={"Authorization": "Basic " + b64encode(self.flower_login.encode()).decode()},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            tasks: dict[str, dict[str, Any]] = json.load(response)
        return tasks

    def save_logs(self) -> Path:
        logs = self.root / "logs.txt"
        logs.write_text(self.compose("logs", "--no-color", "--timestamps", check=False))
        return logs

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "60", timeout=300,
                     check=False)  # fmt: skip


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def task_manifest(name: str, checkpoint_ref: str | None = None) -> str:
    spec: dict[str, Any] = {
        "task": {"agents": 2, "provider": "scripted", "model": "turns=100000,turn_ms=100"}
    }
    if checkpoint_ref is not None:
        spec["resumeFrom"] = {"checkpointRef": checkpoint_ref}
    return yaml.safe_dump({
        "apiVersion": "caliban.caliban-ai.dev/v1alpha1", "kind": "CalibanTask",
        "metadata": {"name": name, "namespace": "default"}, "spec": spec,
    })  # fmt: skip


@pytest.fixture(scope="module")
def stack() -> Iterator[ComposeStack]:
    for tool in ("docker", "docker-compose", "mmdebstrap", "kubectl"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed; run the test with make compose-test")
    if subprocess.run(["docker", "info"], capture_output=True, check=False).returncode != 0:
        pytest.fail("the Docker engine does not answer; run the test with make compose-test")
    taken = [port for port in PORTS.values() if port_open(port)]
    if taken:
        pytest.fail(f"127.0.0.1 ports {taken} are in use; the compose stack needs them free")
    started = time.monotonic()
    app, services = images.build_all()
    built = time.monotonic() - started
    root = Path(tempfile.mkdtemp(prefix="cd-compose-", dir="/tmp"))
    compose = ComposeStack(root, app, services)
    compose.down()  # whatever an interrupted run left
    try:
        yield compose
    finally:
        logs = compose.save_logs()
        compose.down()
        leftover = compose.compose("ps", "-q", check=False).split()
        print(f"\ncompose test: images ready in {built:.0f}s; service logs in {logs}")
        assert leftover == []


def test_a_stack_started_while_postgresql_initialises_waits_for_it_and_ends_healthy(
    stack: ComposeStack,
) -> None:
    up = subprocess.Popen(stack.compose_argv("up", "-d", "--no-build"), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)  # fmt: skip
    needs_postgres = ("db-migrate", "worker", "operator")
    samples = []  # what ran of what needs PostgreSQL, while it was not healthy yet
    while up.poll() is None:
        containers = stack.containers()
        postgres = containers.get("postgres", {}).get("State", {})
        if postgres.get("Running") and postgres["Health"]["Status"] != "healthy":
            samples.append(
                sorted(
                    name
                    for name in needs_postgres
                    if containers.get(name, {}).get("State", {}).get("Running")
                )
            )
        time.sleep(0.5)
    assert up.returncode == 0, up.stdout.read() if up.stdout else ""
    # It was seen initialising, and while it did, nothing that needs it had started.
    assert len(samples) >= 5
    assert samples == [[]] * len(samples)
    wait_until(stack.all_healthy, 180, f"every service healthy (now {stack.health()})")
    migrate = stack.containers()["db-migrate"]["State"]
    assert (migrate["Status"], migrate["ExitCode"]) == ("exited", 0)
    stack.assert_settled()
    assert stack.kubeconfig.exists()
    assert "caliban-dev-snapshots" in stack.kubectl("get", "volumesnapshotclass")
    # The daemons inherit the stand-in controller's environment: no ledger password there.
    controller_env = stack.containers()["sandbox-controller"]["Config"]["Env"]
    assert [e for e in controller_env if e.startswith("DRAIN_DATABASE_URL=")] == []
    # nor the broker's admin URL, nor the message key
    assert [e for e in controller_env
            if e.startswith(("DRAIN_BROKER_ADMIN_URL=", "DRAIN_MESSAGE_KEY="))] == []  # fmt: skip


def test_postgresql_crashing_under_the_running_stack_is_recovered_from(
    stack: ComposeStack,
) -> None:
    stack.up()
    before = stack.restart_counts()
    server = stack.containers()["postgres"]["State"]["Pid"]
    os.kill(server, signal.SIGKILL)  # the container's init: the whole server goes
    wait_until(lambda: stack.restart_counts()["postgres"] == before["postgres"] + 1, 60,
               "PostgreSQL restarted by its restart policy")  # fmt: skip
    wait_until(stack.all_healthy, 180, f"every service healthy again (now {stack.health()})")
    stack.assert_settled()
    # The ledger answers again, through the worker's container.
    assert json.loads(stack.exec_in("worker", "drainctl", "ledger", "ls", "--json")) == []


def test_create_run_delete_checkpoint_and_restore_through_kubectl_ledger_and_flower(
    stack: ComposeStack,
) -> None:
    stack.up()
    stack.kubectl("apply", "-f", "-", stdin=task_manifest("story"))
    pvc = str(stack.wait_phase("story", "Running")["pvcName"])

    def running_agents() -> bool:
        agents = stack.agents_on_disk(pvc)
        return len(agents) == 2 and all(a["turns"] >= 2 for a in agents.values())

    wait_until(running_agents, 120, "2 agents with 2+ turns")
    # The pod's broker user is its namespace's own, which the broker refuses the
    # orchestrator's queue: the agents above ran, and drain below, on that user.
    secret = json.loads(stack.kubectl("get", "secret", "caliban-drain-broker", "-o", "json"))
    tenant = urlsplit(b64decode(secret["data"]["url"]).decode())
    assert unquote(tenant.username or "").startswith(f"{TENANT_USER_PREFIX}default."), tenant
    refused = stack.exec_in(
        "redis", "redis-cli", "-p", str(tenant.port), "--user", unquote(tenant.username or ""),
        "--pass", unquote(tenant.password or ""), "--no-auth-warning",
        "LRANGE", ORCHESTRATOR_QUEUE, "0", "-1",
    )  # fmt: skip
    assert "NOPERM" in refused, refused

    stack.kubectl("delete", "ctask", "story", "--timeout", "120s")
    assert stack.kubectl("get", "ctask", "-o", "name") == ""
    listed = json.loads(stack.exec_in("worker", "drainctl", "ledger", "ls", "--task",
                                      "default/story", "--json"))  # fmt: skip
    assert len(listed) == 1
    checkpoint = listed[0]
    assert (checkpoint["reason"], checkpoint["verified"], checkpoint["forced"]) == (
        "delete", True, False)  # fmt: skip
    assert checkpoint["snapshot_ready_at"] is not None  # the stand-in CSI driver took it
    saved = {a["agent_id"]: a["turns"] for a in checkpoint["agents"]}
    assert {k: v["turns"] for k, v in stack.agents_on_disk(pvc).items()} == saved

    stack.kubectl("apply", "-f", "-", stdin=task_manifest("story-again", checkpoint["ref"]))
    restored_pvc = str(stack.wait_phase("story-again", "Running")["pvcName"])
    assert restored_pvc != pvc
    wait_until(
        lambda: all(stack.agents_on_disk(restored_pvc).get(i, {}).get("turns", 0) > t
                    for i, t in saved.items()),
        120, "every restored agent to do new turns",
    )  # fmt: skip
    restored = stack.agents_on_disk(restored_pvc)
    for agent, turns in saved.items():  # continued at turns+1: nothing lost, none repeated
        assert restored[agent]["user_turns"][: turns + 1] == list(range(1, turns + 2))

    by_name: dict[str, list[dict[str, Any]]] = {}
    for task in stack.flower_tasks().values():
        by_name.setdefault(task["name"], []).append(task)
    operation = checkpoint["operation_id"]
    drains = [t for t in by_name.get("caliban.daemon.drain", []) if operation in str(t["kwargs"])]
    records = [t for t in by_name.get("caliban.orchestrator.record_checkpoint", [])
               if operation in str(t["kwargs"])]  # fmt: skip
    assert [t["state"] for t in drains] == ["SUCCESS"]
    assert [t["state"] for t in records] == ["SUCCESS"]

    stack.kubectl("delete", "ctask", "story-again", "--timeout", "120s")
    assert stack.all_healthy()


def test_flower_answers_only_with_its_login(stack: ComposeStack) -> None:
    stack.up()
    anonymous = f"http://127.0.0.1:{PORTS['FLOWER_PORT']}/api/tasks"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(anonymous, timeout=10)
    assert refused.value.code == 401
    assert isinstance(stack.flower_tasks(), dict)


def test_the_image_clones_a_workspace_source_as_a_tasks_init_container_does(
    stack: ComposeStack,
) -> None:
    """``drainctl sources`` in the image (git in it): a local repository, mounted
    read-only, cloned into a volume folder, then kept on the second run."""
    origin = stack.root / "origin"
    origin.mkdir()
    identity = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
                "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost"}  # fmt: skip
    for argv in (["init", "--quiet", "--initial-branch", "main"], ["add", "."],
                 ["commit", "--quiet", "-m", "first"]):  # fmt: skip
        if argv[0] == "add":
            (origin / "app.py").write_text("print('hi')\n")
        subprocess.run(["git", *argv], cwd=origin, env={**os.environ, **identity}, check=True)
    # The image's user owns it, as a repository it may read (git refuses, as "dubious
    # ownership", one owned by another user).
    for path in (origin, *origin.rglob("*")):
        os.chown(path, IMAGE_UID, IMAGE_UID, follow_symlinks=False)
    volume = stack.root / "volume"
    volume.mkdir()
    shutil.chown(volume, IMAGE_UID, IMAGE_UID)
    sources = json.dumps([{"name": "app", "repo": "file:///origin", "ref": "main"}])
    argv = ["docker", "run", "--rm", "--network", "host", "-v", f"{origin}:/origin:ro",
            "-v", f"{volume}:/workspace", "-e", f"CALIBAN_SOURCES={sources}",
            stack.app_image, "sources", "--into", "/workspace/sources"]  # fmt: skip
    first = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert first.returncode == 0, first.stderr
    assert "source_cloned name=app" in first.stderr
    assert (volume / "sources" / "app" / "app.py").read_text() == "print('hi')\n"
    again = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 0 and "source_kept name=app" in again.stderr, again.stderr
