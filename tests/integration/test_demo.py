"""``drainctl demo`` as a newcomer runs it (``make demo``): the whole story on the
embedded defaults, its summary, Ctrl-C at every step, and what it refuses.

Every run is a real ``drainctl demo`` subprocess, which itself runs ``drainctl dev up``
(embedded API, embedded broker, SQLite ledger, kopf operator, Celery worker, auditor,
stand-in Sandbox controller with real daemons and agents). Runs share one per-user lock,
so this module's tests never overlap.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import psutil
import pytest

from orchestrator.cli.errors import ExitCode
from orchestrator.demo.story import COLUMNS
from tests.support import wait_until

STEPS = ["create", "idle pause", "wake", "delete", "restore", "audit"]


def start_demo(*args: str) -> subprocess.Popen[str]:
    """``drainctl demo`` started with SIGINT ignored, as a shell starts a background job
    (``make demo &``): Ctrl-C must still stop it, so it cannot rely on inheriting
    Python's default handler."""
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "demo", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip


def read_until(stream: IO[str], marker: str, within: float = 90) -> str:
    """Lines of ``stream`` up to and including the first that contains ``marker``."""
    seen = []
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if marker in line:
            return "".join(seen)
    raise AssertionError(f"no line with {marker!r} in:\n{''.join(seen)}")


def family(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    """The demo and everything it started, seen now."""
    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def still_running(processes: list[psutil.Process]) -> list[str]:
    left = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(process.cmdline()[:6]))
        except psutil.NoSuchProcess:
            continue
    return left


@pytest.mark.slow
@pytest.mark.parametrize(
    "marker",
    ["starting the dev stack", *(f"{n}. {step}:" for n, step in enumerate(STEPS, 1))],
    ids=["stack", *STEPS],
)
def test_ctrl_c_at_any_step_stops_everything_it_started(marker: str) -> None:
    """Tried: SIGINT (Ctrl-C) while the stack starts and at the start of every step."""
    demo = start_demo()
    assert demo.stdout is not None
    try:
        read_until(demo.stdout, marker)
        time.sleep(0.3)  # inside the step, not at its first line
        started = family(demo)
        demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 130, out + err
    assert "interrupted: the stack is stopped, nothing is left running" in out
    assert "Traceback" not in err, err
    # the demo and dev up; once the stack is up, also its broker, worker, operator, auditor
    assert len(started) >= (2 if marker.startswith("starting") else 6), len(started)
    wait_until(lambda: not still_running(started), 10, "every process of the demo to be gone")


@pytest.mark.slow
def test_a_second_demo_while_one_runs_says_so_and_leaves_the_first_alone() -> None:
    """Tried: ``drainctl demo`` while another is running."""
    first = start_demo()
    assert first.stdout is not None
    try:
        read_until(first.stdout, "1. create:")
        second = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "demo"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert second.returncode == ExitCode.FAILED
        (line,) = second.stderr.strip().splitlines()
        assert line.startswith("Error: another drainctl demo is running (pid "), line
        assert f"pid {first.pid}," in line
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=120)
    assert first.returncode == 130


def test_a_port_in_use_is_refused_in_one_line() -> None:
    """Tried: ``drainctl demo --port P`` with P held by another socket."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "demo", "--port", str(port)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert result.returncode == ExitCode.FAILED
    assert result.stderr.strip() == (
        f"Error: port {port} on 127.0.0.1 is in use; pick another with --port (0: any free one)"
    )


def test_json_is_refused_for_the_daemon_only_story() -> None:
    """Tried: ``drainctl demo --daemon-only --json``."""
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "demo", "--daemon-only", "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == ExitCode.USAGE
    assert "--json is for the whole story, not --daemon-only" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_the_whole_story_after_interrupted_runs_loses_nothing(tmp_path: Path) -> None:
    """After the Ctrl-C runs above, the next demo works: every step, a table of every
    agent's turns at every point of the story with no lost turn, and nothing left."""
    demo = start_demo("--state-dir", str(tmp_path / "kept"))
    started: list[psutil.Process] = []
    assert demo.stdout is not None
    try:
        head = read_until(demo.stdout, "3. wake:")
        started = family(demo)
        out, err = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
    out = head + out
    assert demo.returncode == 0, out + err
    for n, step in enumerate(STEPS, 1):
        assert f"{n}. {step}:" in out
    assert "kubectl --kubeconfig" in out and "delete ctask demo-story" in out
    header = next(line for line in out.splitlines() if line.startswith("AGENT"))
    assert header.split() == ["AGENT", *(c.upper() for c in COLUMNS), "LOST"]
    rows = [line.split() for line in out.splitlines() if line.startswith("agent-")]
    assert len(rows) == 3
    for row in rows:
        turns = [int(cell) for cell in row[1:-1]]
        assert turns == sorted(turns), row  # never fewer turns at a later point
        assert row[-1] == "0"
    assert "no completed turn was lost" in out
    assert not still_running(started)
    kept = tmp_path / "kept" / "state" / "ledger.db"
    assert kept.exists()  # --state-dir is kept


def summary_problems(summary: dict[str, object]) -> list[str]:
    """What a ``drainctl demo --json`` summary shows went wrong (empty: the story held)."""
    problems = []
    steps = [s["name"] for s in summary["steps"]]  # type: ignore[attr-defined]
    if steps != STEPS:
        problems.append(f"steps {steps}")
    agents: list[dict[str, object]] = summary["agents"]  # type: ignore[assignment]
    if len(agents) != 3:
        problems.append(f"{len(agents)} agents")
    for agent in agents:
        turns: dict[str, int] = agent["turns"]  # type: ignore[assignment]
        if list(turns) != list(COLUMNS):
            problems.append(f"{agent['agent']} read at {list(turns)}")
        seen = [turns[c] for c in COLUMNS if c in turns]
        if seen != sorted(seen) or agent["lost"] != 0:
            problems.append(f"{agent['agent']} lost turns: {turns}")
        if turns.get("woken", 0) <= turns.get("paused", 0):
            problems.append(f"{agent['agent']} did not continue after the wake: {turns}")
        if turns.get("restored", 0) <= turns.get("deleted", 0):
            problems.append(f"{agent['agent']} did not continue after the restore: {turns}")
    checkpoints: dict[str, str] = summary["checkpoints"]  # type: ignore[assignment]
    if sorted(checkpoints) != ["deleted", "paused"] or len(set(checkpoints.values())) != 2:
        problems.append(f"checkpoints {checkpoints}")
    if summary["lost_turns"] != 0 or summary["audit_findings"] or not summary["ok"]:
        problems.append(f"lost {summary['lost_turns']}, audit {summary['audit_findings']}")
    return problems


def run_json_demo(drainctl: list[str], cwd: Path, env: dict[str, str] | None) -> dict[str, object]:
    result = subprocess.run(
        [*drainctl, "demo", "--json"],
        capture_output=True, text=True, timeout=180, check=False, cwd=cwd, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    summary: dict[str, object] = json.loads(result.stdout)
    return summary
