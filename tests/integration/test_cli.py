"""``drainctl`` as the user runs it: real subprocesses, human and JSON output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from orchestrator.cli.errors import ExitCode
from tests.support import DaemonProcess, wait_until


def drainctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_agents_commands_round_trip(daemon: DaemonProcess) -> None:
    sock = str(daemon.socket)
    spawned = drainctl("agents", "--socket", sock, "--json", "spawn", "--count", "2",
                       "--model", "turns=100000,turn_ms=20")  # fmt: skip
    assert spawned.returncode == 0, spawned.stderr
    ids = [json.loads(chunk)["id"] for chunk in spawned.stdout.replace("}\n{", "}\0{").split("\0")]
    assert len(ids) == 2
    wait_until(lambda: all(r.turns >= 1 for r in daemon.records().values()), 30, "turns")

    listing = drainctl("agents", "--socket", sock, "ls")
    assert listing.returncode == 0
    assert all(i in listing.stdout for i in ids) and "STATUS" in listing.stdout

    drained = drainctl("agents", "--socket", sock, "--json", "drain", "--grace", "10")
    refs = json.loads(drained.stdout)["agents"]
    assert {r["id"] for r in refs} == set(ids) and all(r["clean"] for r in refs)

    resumed = drainctl("agents", "--socket", sock, "resume", *[r["session_dir"] for r in refs])
    assert resumed.returncode == 0 and resumed.stdout.count("resumed ") == 2

    status = drainctl("agents", "--socket", sock, "status")
    assert "agents 2" in status.stdout


def test_errors_are_reported_with_a_non_zero_exit(daemon: DaemonProcess, tmp_path: Path) -> None:
    """Tried: killing an unknown agent; talking to a socket nobody listens on."""
    unknown = drainctl("agents", "--socket", str(daemon.socket), "kill", "agent-nope")
    assert unknown.returncode == 1
    assert "not_found: no agent 'agent-nope'" in unknown.stderr
    absent = drainctl("agents", "--socket", str(tmp_path / "none.sock"), "ls")
    assert absent.returncode == ExitCode.UNREACHABLE  # 4 since Step 4 (was 1: no code of its own)
    assert "cannot connect to the daemon" in absent.stderr


def test_demo_runs_the_daemon_story_and_loses_nothing() -> None:
    result = drainctl("demo", "--agents", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no completed turn was lost." in result.stdout
    assert "crashed" in result.stdout
