"""Daemon pods read the broker URL from a Secret, never from their Sandbox's spec.

``drainctl dev up`` (embedded API, broker and SQLite ledger, picked ports, a tmp state
dir) with the daemon broker URL holding a password: the operator keeps Secret
``caliban-drain-broker`` (key ``url``) in the task's namespace, the Sandbox it provisions
points at it through a ``secretKeyRef``, and the password is in no Sandbox, Event or log.
The stand-in Sandbox controller resolves the ref as kubelet does: a Sandbox whose Secret
is missing waits with a ``CreateContainerConfigError`` Event, and starts once it exists.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.devcluster.broker import free_port
from orchestrator.operator.crd import (
    BROKER_SECRET_KEY,
    SANDBOX_KIND,
    SANDBOX_V1ALPHA1,
    sandbox_name,
)
from orchestrator.testing import DevStackProcess, wait_until
from tests.e2e.support import task_manifest

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")

PASSWORD = "hunter2-not-in-any-spec"
SECRET = "caliban-drain-broker"


class Stack(DevStackProcess):
    url: str
    """The daemon broker URL the operator was given (with ``PASSWORD``)."""

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        result = subprocess.run(
            ["kubectl", "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True, text=True, timeout=60, input=stdin, check=False,
        )  # fmt: skip
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result.stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def everything_logged(self) -> str:
        logs = [self.root / "dev-up.log", *sorted(self.state.rglob("*.log"))]
        return "".join(p.read_text(errors="replace") for p in logs if p.is_file())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("stack")
    # A port nothing listens on: the daemons never connect, which these tests do not need.
    url = f"redis://drain:{PASSWORD}@127.0.0.1:{free_port()}/0"
    stack = Stack(root, env={"DRAIN_DAEMON_BROKER_URL": url,
                             "DRAIN_DATABASE_URL": f"sqlite:///{root / 'ledger.db'}"})  # fmt: skip
    stack.url = url
    stack.start()
    try:
        yield stack
    finally:
        stack.stop(90)


def test_a_provisioned_sandbox_reads_the_broker_url_from_the_namespace_secret(
    stack: Stack,
) -> None:
    stack.kubectl("create", "namespace", "team-a")
    stack.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(task_manifest("t1", namespace="team-a")))
    wait_until(lambda: "t1" in stack.kubectl("get", "sandboxes", "-n", "team-a"), 60,
               "the operator to provision the Sandbox")  # fmt: skip
    sandbox = stack.get("sandbox", sandbox_name("t1"), "-n", "team-a")
    (container,) = sandbox["spec"]["podTemplate"]["spec"]["containers"]
    broker_env = [e for e in container["env"] if e["name"] == "DRAIN_BROKER_URL"]
    assert broker_env == [{"name": "DRAIN_BROKER_URL", "valueFrom": {
        "secretKeyRef": {"name": SECRET, "key": BROKER_SECRET_KEY}}}]  # fmt: skip
    assert all("value" not in e for e in container["env"] if e["name"].endswith("_URL"))
    secret = stack.get("secret", SECRET, "-n", "team-a")
    assert base64.b64decode(secret["data"][BROKER_SECRET_KEY]).decode() == stack.url
    assert "ownerReferences" not in secret["metadata"]  # shared by the namespace's tasks

    every_sandbox = json.dumps(stack.get("sandboxes", "--all-namespaces"))
    events = json.dumps(stack.get("events", "--all-namespaces"))
    assert PASSWORD not in every_sandbox
    assert PASSWORD not in events
    assert PASSWORD not in stack.everything_logged()


def test_a_sandbox_whose_secret_is_missing_waits_with_a_config_error_then_starts(
    stack: Stack, tmp_path: Path
) -> None:
    stack.kubectl("create", "namespace", "team-b")
    seen = tmp_path / "seen.txt"
    script = "import os,sys; open(sys.argv[1],'w').write(os.environ['TOKEN'])"
    sandbox = {
        "apiVersion": SANDBOX_V1ALPHA1, "kind": SANDBOX_KIND,
        "metadata": {"name": "reader", "namespace": "team-b"},
        "spec": {"replicas": 1, "podTemplate": {"spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "reader", "command": [sys.executable, "-c", script, str(seen)],
                            "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {
                                "name": "reader-token", "key": "token"}}}]}],
        }}},
    }  # fmt: skip
    stack.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(sandbox))

    def config_errors() -> list[str]:
        items = stack.get("events", "-n", "team-b")["items"]
        return [e["message"] for e in items if e.get("reason") == "CreateContainerConfigError"]

    wait_until(config_errors, 60, "a CreateContainerConfigError event")
    assert config_errors() == ['Error: secret "reader-token" not found']
    assert not seen.exists()

    token = {"apiVersion": "v1", "kind": "Secret",
             "metadata": {"name": "reader-token", "namespace": "team-b"},
             "stringData": {"token": "t0ken"}}  # fmt: skip
    stack.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(token))
    wait_until(seen.exists, 60, "the pod to start once its Secret exists")
    wait_until(lambda: seen.read_text() == "t0ken", 10, "the token written")
    stack.kubectl("delete", "sandbox", "reader", "-n", "team-b")
