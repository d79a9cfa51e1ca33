"""``python -m bench --quick`` (the CI smoke of the benchmarks) runs every scenario on
this machine's Redis and answers figures and checks for each."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pipeline_support import REDIS_PORT, redis_db_url

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.bench  # make bench-test: alone, after the suite
QUICK_RUN_SECS = 600
"""How long the quick run may take: about a minute on a quiet machine (4 scenarios side
by side, ``bench.scenarios.QUICK_JOBS``), several times that on a loaded one."""


@pytest.mark.timeout(QUICK_RUN_SECS + 30)
def test_the_quick_benchmark_exits_0_with_results_for_every_scenario(tmp_path: Path) -> None:
    redis_db_url(13)  # skips, saying how to start it, when Redis is not there
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    copy = tmp_path / "bench"
    shutil.copytree(REPO / "bench", copy)  # --write must not touch the checkout's results
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--write", "--redis-port", str(REDIS_PORT)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=QUICK_RUN_SECS, check=False,
    )  # fmt: skip
    # Exit 2: a scenario raised (its traceback on stderr) or a correctness check failed
    # (its FAIL line, which may be far from the tail of a long report).
    failures = "\n".join(line for line in done.stdout.splitlines() if "FAIL" in line)
    assert done.returncode == 0, f"{failures}\n{done.stderr[-4000:]}\n{done.stdout[-1500:]}"
    results = json.loads((copy / "results.json").read_text())
    assert results["quick"] is True
    assert sorted(results["scenarios"]) == [
        "audit", "burst", "controlplane", "delete", "drain", "fanout", "fleet", "ledger",
        "pipeline", "recovery", "resume", "wake",
    ]  # fmt: skip
    for name, scenario in results["scenarios"].items():
        assert scenario["checks"], name
        assert all(c["ok"] for c in scenario["checks"] if not c["budget"]), (name, scenario)
        if "curves" in scenario["data"]:  # drawn with --write beside results.json
            assert scenario["plot"] == f"plots/{name}.png"
            assert (copy / "plots" / f"{name}.png").read_bytes().startswith(b"\x89PNG")
    assert "curves" in results["scenarios"]["ledger"]["data"]
    text = (copy / "RESULTS.md").read_text()
    assert "python -m bench --quick --write" in text
    assert text.count("### ") >= 3
