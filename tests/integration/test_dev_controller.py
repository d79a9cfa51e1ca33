"""``drainctl dev controller``: the stand-in Sandbox controller attached to an API that
another process serves (``drainctl dev cluster``), as the compose stack runs the two.

Bad input ends in one line and a non-zero exit, never a traceback; a controller started
before its API waits for it, then makes snapshots possible (the default
VolumeSnapshotClass) and stops on SIGTERM."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.devcluster import DEV_SNAPSHOT_CLASS
from tests.integration.cli_support import drainctl
from tests.pipeline_support import free_port
from tests.support import wait_until

UNREADABLE = """apiVersion: v1
clusters: [
"""
NO_CONTEXT = """apiVersion: v1
kind: Config
"""
NOTHING_LISTENS = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:PORT"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


@pytest.mark.parametrize(
    ("kubeconfig_text", "expected"),
    [
        (None, "does not exist yet; start the API (drainctl dev cluster --kubeconfig"),
        (UNREADABLE, "cannot be read as a kubeconfig: while parsing"),
        (NO_CONTEXT, "cannot be read as a kubeconfig: Invalid kube-config file"),
        (NOTHING_LISTENS, "does not answer"),
    ],
    ids=["never-appears", "not-yaml", "no-context", "nothing-listens"],
)
def test_a_kubeconfig_that_leads_to_no_api_ends_in_one_line(
    tmp_path: Path, kubeconfig_text: str | None, expected: str
) -> None:
    kubeconfig = tmp_path / "kubeconfig.yaml"
    if kubeconfig_text is not None:
        kubeconfig.write_text(kubeconfig_text.replace("PORT", str(free_port())))
    result = drainctl("dev", "controller", "--state-dir", str(tmp_path / "state"),
                      "--kubeconfig", str(kubeconfig), "--wait", "1")  # fmt: skip
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1
    assert expected in errors[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--state-dir", "a-file"],
            "Invalid value for '--state-dir': Directory 'a-file' is a file",
        ),
        (["--state-dir", "s", "--kubeconfig", "."], "Invalid value for '--kubeconfig'"),
        (["--state-dir", "s", "--wait", "-1"], "Invalid value for '--wait'"),
        (["--kubeconfig", "k.yaml"], "Missing option '--state-dir'"),
    ],
    ids=["state-dir-is-a-file", "kubeconfig-is-a-dir", "negative-wait", "no-state-dir"],
)
def test_bad_arguments_are_usage_errors(tmp_path: Path, args: list[str], expected: str) -> None:
    (tmp_path / "a-file").write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "dev", "controller", *args],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False,
        env={"PATH": "/usr/bin:/bin", "KUBECONFIG": str(tmp_path / "k.yaml")},
    )  # fmt: skip
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert expected in result.stderr


@pytest.fixture
def controller_then_cluster(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """The controller started first, then ``drainctl dev cluster`` writing the kubeconfig
    it waits for; both stopped with SIGTERM at the end."""
    kubeconfig = tmp_path / "kube" / "kubeconfig.yaml"
    controller = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "dev", "controller", "--state-dir",
         str(tmp_path / "state"), "--kubeconfig", str(kubeconfig), "--wait", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    cluster = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "dev", "cluster", "--port", str(free_port()),
         "--kubeconfig", str(kubeconfig), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield controller, kubeconfig
    finally:
        for proc in (controller, cluster):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def test_a_controller_started_before_its_api_waits_then_serves_snapshots_and_stops_on_sigterm(
    controller_then_cluster: tuple[subprocess.Popen[str], Path],
) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("needs the kubectl binary")
    controller, kubeconfig = controller_then_cluster

    def snapshot_class_driver() -> str | None:
        if not kubeconfig.exists():
            return None
        got = subprocess.run(
            ["kubectl", "--kubeconfig", str(kubeconfig), "get", "volumesnapshotclass",
             DEV_SNAPSHOT_CLASS, "-o", "json"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        return str(json.loads(got.stdout)["driver"]) if got.returncode == 0 else None

    driver = wait_until(snapshot_class_driver, 60, "the stand-in driver's VolumeSnapshotClass")
    assert driver == "dev.caliban-drain.io/hostpath"
    controller.send_signal(signal.SIGTERM)
    output, _ = controller.communicate(timeout=30)
    assert controller.returncode == 0
    assert "event=dev_controller_running" in output
    assert "event=dev_controller_stopping" in output
    assert "Traceback" not in output
