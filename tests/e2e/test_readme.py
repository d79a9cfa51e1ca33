"""The README's lifecycle block, run as written: ``drainctl dev up`` in the background,
then every transition with the real ``kubectl`` (create, pause, resume, delete, restore,
idle pause, wake), the ledger, the audit, and the stack stopped. A README command that
stops working fails this test."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARKER = "<!-- This block is run as written by tests/e2e/test_readme.py. -->"


def readme_blocks() -> list[str]:
    """Every ```bash block right after :data:`MARKER`, in README order."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = []
    for after in text.split(MARKER)[1:]:
        found = re.match(r"\s*```bash\n(.*?)\n```", after, re.S)
        assert found, "a tested README block is not a ```bash block right after its marker"
        blocks.append(found.group(1))
    return blocks


def run_block(block: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``block`` under ``bash -euo pipefail`` in ``cwd`` (which has the repository's
    ``deploy/``), with this venv's ``drainctl`` first on ``PATH`` and no ``DRAIN_*``
    or ``KUBECONFIG`` from this environment."""
    (cwd / "deploy").symlink_to(REPO / "deploy")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("DRAIN_") and k not in {"KUBECONFIG", "VIRTUAL_ENV"}
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail\n{block}\n"], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=420, check=False,
    )  # fmt: skip


def test_the_readme_has_its_tested_blocks() -> None:
    blocks = readme_blocks()
    assert len(blocks) == 2
    assert "kubectl delete ctask" in blocks[0] and "drainctl daemon" in blocks[1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_readme_lifecycle_block_runs_as_written(tmp_path: Path) -> None:
    ran = run_block(readme_blocks()[0], tmp_path)
    assert ran.returncode == 0, f"{ran.stdout}\n{ran.stderr[-4000:]}"
    listed = ran.stdout
    assert re.search(r"^demo-restore\s+Running", listed, re.M), listed
    assert re.search(r"^demo-idle-pause\s+Running", listed, re.M), listed
    assert 'calibantask.caliban.caliban-ai.dev "demo-basic" deleted' in listed
    assert "no findings" in listed or "clean" in listed, listed


def test_the_readme_daemon_block_runs_as_written(tmp_path: Path) -> None:
    ran = run_block(readme_blocks()[1], tmp_path)
    assert ran.returncode == 0, f"{ran.stdout}\n{ran.stderr[-4000:]}"
    assert ran.stdout.count("spawned agent-") == 3, ran.stdout
    assert ran.stdout.count("resumed agent-") == 3, ran.stdout
    assert '"agents": 3' in ran.stdout, ran.stdout
