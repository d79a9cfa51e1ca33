"""caliban-operator's Workspace API end to end, with the real kubectl against ``drainctl dev
up`` (embedded API, stand-in Sandbox controller, SQLite ledger) on a Redis server of the
test's own, so every command the stack sends its broker can be recorded (MONITOR).

Upstream's sample Workspace (its hosts rewritten to 127.0.0.1) with its git source
pointed at a local repository and one more provider, ``gateway``: an OpenAI-compatible
HTTP server on 127.0.0.1 run by the test, with an API key in a Secret. A task naming
that Workspace waits Pending until it exists; bound to ``gateway`` its agent's turn is
answered by that server with the key; the source is cloned into the workspace once and
kept across a pause and resume (its remote is gone by then). A task bound to the
sample's default provider (kind ``anthropic``) is refused with a condition, creates
nothing, and starts once its ``providerRef`` is corrected. The key reaches the model
server and nothing else: no log, event, API object but the Secret, ledger row, process
argument or Celery message holds it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from orchestrator.devcluster.persistence import API_STATE_FILE
from orchestrator.operator.crd import sandbox_name
from orchestrator.testing.servers import ModelServer
from tests import upstream
from tests.e2e.support import DevStack, task_manifest
from tests.pipeline_support import private_redis
from tests.support import wait_until
from worker_agent.session import load_session

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed"),
]

API_KEY = "sk-local-7f3a9c1e-never-logged"
REPLY = "the gateway model answers"
SANDBOXES = "sandboxes.v1beta1.agents.x-k8s.io"  # what a task with no apiVersion gets


class BrokerRecorder(threading.Thread):
    """Every command the broker is sent, through Redis's MONITOR on a plain socket (its
    replies are text lines, one per command), until the server closes it."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(b"MONITOR\r\n")
        assert self.sock.recv(5) == b"+OK\r\n"
        self.sock.settimeout(None)
        self.received = bytearray()

    def run(self) -> None:
        with contextlib.suppress(OSError):
            while chunk := self.sock.recv(65536):
                self.received += chunk

    @property
    def commands(self) -> list[str]:
        return bytes(self.received).decode(errors="replace").splitlines()

    def bodies(self) -> list[str]:
        """The decoded bodies of the kombu messages among the commands."""
        found = (m for c in self.commands for m in _BODY.findall(c))
        return [base64.b64decode(b).decode(errors="replace") for b in found]


_BODY = re.compile(r'\\?"body\\?": \\?"([A-Za-z0-9+/=]{8,})')


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    server = ModelServer(lambda _body: REPLY).start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def broker() -> Iterator[tuple[str, BrokerRecorder]]:
    with private_redis() as (url, _, port):
        recorder = BrokerRecorder(port)
        recorder.start()
        yield url, recorder


@pytest.fixture(scope="module")
def stack(broker: tuple[str, BrokerRecorder]) -> Iterator[DevStack]:
    root = Path(tempfile.mkdtemp(prefix="cd-workspace-", dir="/tmp"))
    dev = DevStack(root, broker[0], f"sqlite:///{root / 'ledger.db'}")
    try:
        yield dev
    finally:
        dev.close()


def git(*args: str, cwd: Path) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost"}  # fmt: skip
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)


def local_repo(root: Path) -> Path:
    repo = root / "origin" / "caliban"
    repo.mkdir(parents=True)
    git("init", "--quiet", "--initial-branch", "main", cwd=repo)
    (repo / "auth.py").write_text("def login(): ...\n")
    git("add", "auth.py", cwd=repo)
    git("commit", "--quiet", "-m", "auth", cwd=repo)
    return repo


def the_workspace(repo: Path, model: ModelServer) -> dict[str, Any]:
    """Upstream's sample, localized: its source is our repository, plus ``gateway``."""
    ws = upstream.local_samples()["workspace.yaml"]
    ws["metadata"]["namespace"] = "default"
    ws["spec"]["sources"][0]["repo"] = f"file://{repo}"
    ws["spec"]["providers"].append({
        "name": "gateway", "kind": "openai", "baseUrl": model.base_url, "model": "gpt-local",
        "credentialsRef": {"secretName": "gateway-key", "key": "api-key"},
    })  # fmt: skip
    return ws


def bound_task(name: str, provider_ref: str | None) -> dict[str, Any]:
    manifest = task_manifest(name, agents=1)
    manifest["spec"]["task"] = {"agents": 1, "prompt": f"refactor the auth module ({name})"}
    manifest["spec"]["workspaceRef"] = {"name": "team-a-ws"}
    if provider_ref is not None:
        manifest["spec"]["providerRef"] = provider_ref
    return manifest


def resolved(stack: DevStack, name: str) -> dict[str, Any] | None:
    conditions = stack.status("default", name).get("conditions") or []
    return next((c for c in conditions if c.get("type") == "WorkspaceResolved"), None)


def patch_spec(stack: DevStack, name: str, spec: dict[str, Any]) -> None:
    stack.kubectl("patch", "ctask", name, "--type=merge", "-p", json.dumps({"spec": spec}))


def every_file(root: Path) -> Iterator[Path]:
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            yield path


def test_a_workspace_task_clones_once_reaches_its_model_and_leaks_no_key(
    stack: DevStack, model: ModelServer, broker: tuple[str, BrokerRecorder]
) -> None:
    repo = local_repo(stack.root)
    # Named before the Workspace exists: Pending, saying so, nothing created.
    assert stack.apply(bound_task("refactor-auth", "gateway")).returncode == 0
    waiting = wait_until(lambda: resolved(stack, "refactor-auth"), 60, "WorkspaceResolved")
    assert (waiting["status"], waiting["reason"]) == ("False", "WorkspaceNotFound"), waiting
    assert stack.status("default", "refactor-auth")["phase"] == "Pending"
    # The default provider of upstream's sample is anthropic: refused, not run as another.
    assert stack.apply(bound_task("planner-task", None)).returncode == 0

    stack.kubectl("create", "secret", "generic", "gateway-key", f"--from-literal=api-key={API_KEY}")
    assert stack.apply(the_workspace(repo, model)).returncode == 0
    stack.wait_phase("default", "refactor-auth", "Running", timeout=120)
    done = resolved(stack, "refactor-auth")
    assert done is not None and (done["status"], done["reason"]) == ("True", "Resolved")
    pinned = stack.status("default", "refactor-auth")["resolvedWorkspace"]
    assert pinned["provider"] == {
        "name": "gateway", "kind": "openai", "model": "gpt-local", "baseUrl": model.base_url,
        "credentialsRef": {"secretName": "gateway-key", "key": "api-key"},
    }  # fmt: skip

    # The agent's turn went to the gateway, with the key; its reply is in the session.
    wait_until(lambda: model.requests, 60, "the agent's request to the model server")
    path, auth, body = model.requests[0]
    assert (path, auth, body["model"]) == ("/v1/chat/completions", f"Bearer {API_KEY}", "gpt-local")
    assert body["messages"][-1]["content"] == "refactor the auth module (refactor-auth)"
    pvc = stack.pvc_of("refactor-auth")
    [agent] = wait_until(lambda: stack.agent_dirs("default", pvc), 30, "the agent's directory")
    wait_until(lambda: load_session(agent).turns >= 1, 60, "the agent's first turn on disk")
    assert REPLY in json.dumps(load_session(agent).messages)

    # Its NetworkPolicy lets the pod reach the provider's port too.
    policy = json.loads(stack.kubectl("get", "netpol", "refactor-auth-netpol", "-o", "json").stdout)
    reached = [p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"]]
    assert int(model.base_url.rsplit(":", 1)[1].split("/")[0]) in reached, reached
    # The source is on the workspace volume, cloned once by the init container.
    checkout = stack.volume("default", pvc) / "sources" / "caliban"
    assert (checkout / "auth.py").read_text() == "def login(): ...\n"
    pod_log = stack.state / "sandboxes" / "logs" / f"default.{sandbox_name('refactor-auth')}.log"
    assert pod_log.read_text().count("source_cloned name=caliban") == 1

    # Planner: refused with its reason, one Warning event, no Sandbox; fixed, it starts.
    refused = wait_until(
        lambda: (c := resolved(stack, "planner-task")) and c["reason"] != "WorkspaceNotFound" and c,
        60, "planner-task's refusal",
    )  # fmt: skip
    assert (refused["status"], refused["reason"]) == ("False", "UnsupportedProviderKind")
    assert "kind anthropic, which caliban-drain cannot drive yet" in refused["message"]
    assert stack.status("default", "planner-task")["phase"] == "Pending"
    reasons = [e["reason"] for e in stack.events_of("planner-task") if e["type"] == "Warning"]
    assert reasons.count("UnsupportedProviderKind") == 1, reasons
    sandboxes = stack.kubectl("get", SANDBOXES, "-o", "name").stdout
    assert sandbox_name("planner-task") not in sandboxes
    patch_spec(stack, "planner-task", {"providerRef": "workers"})
    wait_until(
        lambda: (resolved(stack, "planner-task") or {}).get("status") == "True", 60,
        "planner-task bound to workers once its providerRef is corrected",
    )  # fmt: skip
    stack.kubectl("delete", "ctask", "planner-task", "--wait=false")

    # Paused and resumed over the kept PVC, with the remote gone: not fetched again.
    (checkout / "notes.md").write_text("an agent's work in the checkout\n")
    repo.rename(repo.with_name("moved-away"))
    patch_spec(stack, "refactor-auth", {"lifecycle": {"suspend": True}})
    stack.wait_phase("default", "refactor-auth", "Suspended", timeout=120)
    # The pod really goes (the Sandbox controller acts on the suspension on its next
    # look): resumed at once, the same pod could carry on and no new one would start.
    wait_until(lambda: not stack.daemon_pids(pvc), 60, "the suspended pod to be gone")
    patch_spec(stack, "refactor-auth", {"lifecycle": {"suspend": False}})
    stack.wait_phase("default", "refactor-auth", "Running", timeout=120)
    log = pod_log.read_text()
    assert log.count("source_cloned name=caliban") == 1 and "source_kept name=caliban" in log
    assert (checkout / "notes.md").read_text() == "an agent's work in the checkout\n"

    # The key is in no process's arguments while everything runs ...
    for process in psutil.process_iter(["cmdline"]):
        assert API_KEY not in " ".join(process.info["cmdline"] or []), process.info
    # ... in no event, nor any API object but its Secret ...
    events = stack.kubectl("get", "events", "-A", "-o", "json").stdout
    objects = stack.kubectl("get", "ctask,cws," + SANDBOXES, "-A", "-o", "json").stdout
    assert API_KEY not in events and API_KEY not in objects
    # ... in no Celery message the stack sent ...
    bodies = broker[1].bodies()
    # The recorder saw the stack's messages, bodies decoded: the resume of this task.
    assert any("refactor-auth" in b or "resume" in b for b in bodies), len(bodies)
    assert not [c for c in broker[1].commands if API_KEY in c]
    assert not [b for b in bodies if API_KEY in b]
    stack.kubectl("delete", "ctask", "refactor-auth", timeout=120)
    wait_until(lambda: stack.task("default", "refactor-auth") is None, 120, "the task gone")
    assert stack.ledger.latest_checkpoint("default", "refactor-auth") is not None
    # ... and in no file the stack wrote: logs, the ledger, the workspace volume. Only the
    # API's own store holds the Secret, base64-encoded, as etcd does.
    encoded = base64.b64encode(API_KEY.encode())
    for written in every_file(stack.root):
        data = written.read_bytes()
        assert API_KEY.encode() not in data, written
        # The store's file, or the copy it is being written through, caught mid-save.
        if written.name not in (API_STATE_FILE, f".{API_STATE_FILE}.tmp"):
            assert encoded not in data, written
