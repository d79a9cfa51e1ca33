"""Fixtures shared by the integration tests: the embedded Kubernetes API."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pipeline_support import free_port
from tests.support import wait_until


@pytest.fixture
def dev_cluster(tmp_path: Path) -> Iterator[Path]:
    """``drainctl dev cluster`` as a subprocess; yields its kubeconfig once it is ready."""
    kubeconfig = tmp_path / "kubeconfig.yaml"
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "dev", "cluster", "--port", str(free_port()),
         "--kubeconfig", str(kubeconfig), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(kubeconfig.exists, 30, "the embedded API's kubeconfig")
        yield kubeconfig
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
