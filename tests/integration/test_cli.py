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


def test_agents_prompt_sends_a_turn_to_a_live_agent(daemon: DaemonProcess) -> None:
    sock = str(daemon.socket)
    (agent,) = daemon.spawn(1, "turns=1,turn_ms=20")
    wait_until(lambda: daemon.records()[agent].status.value == "idle", 30, "the agent to idle")
    sent = drainctl("agents", "--socket", sock, "--json", "prompt", agent, "one more, please")
    assert sent.returncode == 0, sent.stderr
    assert json.loads(sent.stdout) == {"id": agent, "queued": 1}
    wait_until(lambda: daemon.records()[agent].turns == 2, 30, "the prompted turn")
    human = drainctl("agents", "--socket", sock, "prompt", agent, "and another")
    assert human.stdout.startswith(f"prompt queued for {agent}"), human.stdout


def test_agents_prompt_refuses_an_unknown_or_stopped_agent(daemon: DaemonProcess) -> None:
    """Tried: prompting an agent id nobody has, and an agent that was killed."""
    sock = str(daemon.socket)
    unknown = drainctl("agents", "--socket", sock, "prompt", "agent-nope", "hello")
    assert unknown.returncode == ExitCode.FAILED
    assert unknown.stderr.strip() == "Error: the daemon refused: not_found: no agent 'agent-nope'"
    (agent,) = daemon.spawn(1, "turns=1,turn_ms=20")
    assert drainctl("agents", "--socket", sock, "kill", agent).returncode == 0
    stopped = drainctl("agents", "--socket", sock, "prompt", agent, "hello")
    assert stopped.returncode == ExitCode.FAILED
    assert "resume it before attaching" in stopped.stderr
    assert "Traceback" not in unknown.stderr + stopped.stderr
    assert len(stopped.stderr.strip().splitlines()) == 1


def test_a_daemon_and_its_agents_on_a_deep_path_serve_their_sockets(tmp_short: Path) -> None:
    """The control socket and each agent's attach socket (in its session dir) on a path
    longer than a socket address holds (107 bytes), as under a deep ``--state-dir``:
    the daemon serves, its agents report to it (idle), and a prompt reaches them."""
    deep = tmp_short / ("d" * (110 - len(str(tmp_short))))
    proc = DaemonProcess(deep).start()
    assert len(str(proc.socket)) > 107
    try:
        (agent,) = proc.spawn(1, "turns=1,turn_ms=20")
        endpoint = proc.records()[agent].session_dir + "/agent.sock"
        assert len(endpoint) > 107, endpoint
        wait_until(lambda: proc.records()[agent].status.value == "idle", 30, "the agent to idle")
        sent = drainctl("agents", "--socket", str(proc.socket), "prompt", agent, "deep hello")
        assert sent.returncode == 0, sent.stderr
        wait_until(lambda: proc.records()[agent].turns == 2, 30, "the prompted turn")
    finally:
        proc.stop()


def test_demo_daemon_only_runs_the_daemon_story_and_loses_nothing() -> None:
    result = drainctl("demo", "--daemon-only", "--agents", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no completed turn was lost." in result.stdout
    assert "crashed" in result.stdout
