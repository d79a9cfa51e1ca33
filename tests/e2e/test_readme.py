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


def readme_block() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    after = text.split(MARKER, 1)[1]
    found = re.match(r"\s*```bash\n(.*?)\n```", after, re.S)
    assert found, "the README's tested block is not a ```bash block right after its marker"
    return found.group(1)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_readme_lifecycle_block_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / "deploy").symlink_to(REPO / "deploy")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("DRAIN_") and k not in {"KUBECONFIG", "VIRTUAL_ENV"}
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    script = f"set -euo pipefail\n{readme_block()}\n"
    ran = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=420, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, f"{ran.stdout}\n{ran.stderr[-4000:]}"
    listed = ran.stdout
    assert re.search(r"^demo-restore\s+Running", listed, re.M), listed
    assert re.search(r"^demo-idle-pause\s+Running", listed, re.M), listed
    assert 'calibantask.caliban.caliban-ai.dev "demo-basic" deleted' in listed
    assert "no findings" in listed or "clean" in listed, listed
