"""Disruptions end to end: an evicted, restarted or killed pod resumes its agents by itself.

``drainctl dev up`` runs the real operator, worker, daemons and agents; the disruption is
a real signal to a real process (SIGTERM to the daemon is what an eviction or ``kubectl
drain`` sends; SIGKILL of the daemon is a node loss; SIGKILL of one agent's worker is a
crash or an OOM kill), while the agents are mid-turn. Each test checks what the product
promises: every agent continues at ``turns + 1`` (its transcript announces turns 1…N,
each once, and N only grows past what was saved), exactly one recovery operation per
disruption in the ledger, and ``kubectl get -w`` sees the task leave Running and come
back, with a Warning event for the disruption and a Normal one for the recovery.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from orchestrator.ledger import OperationKind
from orchestrator.operator.crd import sandbox_name
from tests.e2e.support import DevStack, Watch, task_manifest
from tests.pipeline_support import fresh_postgres, redis_db_url
from tests.support import wait_until
from worker_agent import layout
from worker_agent.children import descendants
from worker_agent.session import load_session
from worker_agent.testing import DRAINCTL
from worker_agent.transcript import completed_turn

pytestmark = pytest.mark.slow

AGENTS = 3
MODEL = "turns=100000,turn_ms=300"
SLOW_TURNS = "turns=100000,turn_ms=1500"
"""A worker finishes the turn it is in before it exits on SIGTERM: slow turns keep a
drain on its way long enough for an eviction to land inside it."""
RECOVERY_BOUND_SECS = 90.0
"""Generous: what the tests measured is in bench/RESULTS.md (``python -m bench``)."""


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    root = Path(tempfile.mkdtemp(prefix="cd-disrupt-", dir="/tmp"))
    dev = DevStack(root, redis_db_url(db=12), fresh_postgres())
    try:
        yield dev
        # Whatever the module's tests did, the ledger says only what is so.
        assert dev.ledger_contradictions() == []
        assert dev.audit_findings() == []
    finally:
        dev.close()


# ------------------------------------------------------------------------ helpers


def saved_turns(stack: DevStack, pvc: str) -> dict[str, int]:
    return {d.name: load_session(d).turns for d in stack.agent_dirs("default", pvc)
            if layout.session_file(d).exists()}  # fmt: skip


def announced_turns(directory: Path) -> list[int]:
    """The turn numbers the transcript announced, in order (a torn last line skipped)."""
    turns = []
    for line in layout.transcript_file(directory).read_bytes().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        turn = completed_turn(event) if isinstance(event, dict) else None
        if turn is not None:
            turns.append(turn)
    return turns


def daemon_of(stack: DevStack, pvc: str) -> psutil.Process:
    """The task's daemon: the stack's process that serves the PVC's volume as its store."""
    volume = str(stack.volume("default", pvc))

    def find() -> psutil.Process | None:
        for pid in descendants(stack.pid):
            try:
                process = psutil.Process(pid)
                argv = process.cmdline()
            except psutil.Error:
                continue
            if "worker_agent.reaper" in argv or "--store" not in argv:
                continue  # the pod's reaper carries the daemon's argv too
            if "daemon" in argv and argv[argv.index("--store") + 1] == volume:
                return process
        return None

    return wait_until(find, 60, f"the daemon of {pvc}")


def worker_of(stack: DevStack, pvc: str, agent: str) -> psutil.Process:
    """The worker process running ``agent`` (its cwd is the agent's session dir)."""
    directory = layout.agents_dir(stack.volume("default", pvc)) / agent

    def find() -> psutil.Process | None:
        for child in daemon_of(stack, pvc).children(recursive=True):
            try:
                if Path(child.cwd()) == directory:
                    return child
            except psutil.Error:
                continue
        return None

    return wait_until(find, 30, f"the worker of {agent}")


def recoveries(stack: DevStack, name: str, uid: str) -> list[str]:
    return [op.id for op in stack.ledger.list_operations(namespace="default", name=name)
            if op.task_uid == uid and ":recover:" in op.idempotency_key]  # fmt: skip


def events(stack: DevStack, name: str) -> list[tuple[str, str]]:
    listed = stack.kubectl("get", "events", "-o", "json", "--field-selector",
                           f"involvedObject.name={name}").stdout  # fmt: skip
    return [(e.get("type", ""), e.get("reason", "")) for e in json.loads(listed)["items"]]


class PhaseWatch(Watch):
    """Every phase the API served for one task, repeats folded."""

    def __init__(self, stack: DevStack, name: str, root: Path) -> None:
        super().__init__(stack, root, "ctask", name, "-o", 'jsonpath={.status.phase}{"\\n"}')

    def phases(self) -> list[str]:
        seen: list[str] = []
        for line in self.lines():
            if not seen or seen[-1] != line:
                seen.append(line)
        return seen


@dataclass
class Running:
    name: str
    pvc: str
    uid: str


def start_task(stack: DevStack, name: str, model: str = MODEL, **lifecycle: str) -> Running:
    manifest = task_manifest(name, agents=AGENTS, model=model, **lifecycle)
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", name, "Running")
    pvc = stack.pvc_of(name)
    wait_until(lambda: len(saved_turns(stack, pvc)) == AGENTS
               and min(saved_turns(stack, pvc).values()) >= 2, 60, "agents mid-work")  # fmt: skip
    uid = str(stack.task("default", name)["metadata"]["uid"])  # type: ignore[index]
    return Running(name, pvc, uid)


def assert_every_turn_announced_once(stack: DevStack, pvc: str) -> dict[str, int]:
    """Nothing lost, nothing repeated: each transcript announces turns 1…N in order, N
    being the turns its session.json saved (one may be mid-announcement)."""
    now = saved_turns(stack, pvc)
    for directory in stack.agent_dirs("default", pvc):
        announced = announced_turns(directory)
        assert announced == list(range(1, len(announced) + 1)), directory.name
        assert len(announced) in (now[directory.name], now[directory.name] - 1), directory.name
    return now


def wait_recovered(
    stack: DevStack, task: Running, before: dict[str, int], watch: PhaseWatch
) -> float:
    """Wait until every agent has gone past the turns it had saved and the task is
    Running with AgentsAvailable True; answer how long it took."""
    started = time.monotonic()

    def recovered() -> bool:
        status = stack.status("default", task.name)
        available = {c["type"]: c for c in status.get("conditions") or []}.get("AgentsAvailable")
        turns = saved_turns(stack, task.pvc)
        return (
            status.get("phase") == "Running"
            and available is not None
            and available["status"] == "True"
            and all(turns[a] > before[a] for a in before)
        )

    wait_until(recovered, RECOVERY_BOUND_SECS, f"{task.name} to recover from {before}")
    took = time.monotonic() - started
    # The watch (kubectl get -w writing a file) can lag the status just read: let it
    # catch up with the Running seen before reading what it recorded.
    wait_until(lambda: watch.phases()[-1:] == ["Running"], 30, "the watch to see Running")
    phases = watch.phases()
    assert phases[0] == "Running", phases
    assert phases[-1] == "Running", phases
    assert set(phases[1:-1]) & {"Resuming", "Provisioning"}, f"never left Running: {phases}"
    return took


def gone(process: psutil.Process) -> bool:
    return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE


# -------------------------------------------------------------------------- tests


def test_an_evicted_daemon_drains_and_its_agents_resume_by_themselves(
    stack: DevStack, tmp_path: Path
) -> None:
    task = start_task(stack, "evicted")
    sandbox = json.loads(
        stack.kubectl("get", "sandbox", sandbox_name(task.name), "-o", "json").stdout
    )
    grace = sandbox["spec"]["podTemplate"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > 30  # the default drainGracePeriod: an eviction's SIGTERM drain fits in it
    daemon = daemon_of(stack, task.pvc)
    watch = PhaseWatch(stack, task.name, tmp_path)
    try:
        daemon.send_signal(signal.SIGTERM)  # what an eviction sends the container
        wait_until(lambda: gone(daemon), 60, "the evicted daemon to exit")
        flushed = saved_turns(stack, task.pvc)
        wait_recovered(stack, task, flushed, watch)
    finally:
        watch.close()
    assert_every_turn_announced_once(stack, task.pvc)
    assert len(recoveries(stack, task.name, task.uid)) == 1
    seen = events(stack, task.name)
    assert ("Warning", "AgentsInterrupted") in seen
    assert ("Normal", "Recovered") in seen
    stack.kubectl("delete", "ctask", task.name, timeout=120)
    [checkpoint] = stack.ledger.list_checkpoints(namespace="default", name=task.name)
    assert checkpoint.verified and checkpoint.task_uid == task.uid


def test_a_daemon_killed_outright_comes_back_and_resumes_its_crashed_agents(
    stack: DevStack, tmp_path: Path
) -> None:
    task = start_task(stack, "node-lost")
    daemon = daemon_of(stack, task.pvc)
    workers = [worker_of(stack, task.pvc, d.name) for d in stack.agent_dirs("default", task.pvc)]
    watch = PhaseWatch(stack, task.name, tmp_path)
    try:
        daemon.send_signal(signal.SIGKILL)  # a node lost: nothing runs a handler
        wait_until(lambda: all(gone(p) for p in [daemon, *workers]), 30, "daemon and workers gone")
        saved = saved_turns(stack, task.pvc)
        wait_recovered(stack, task, saved, watch)
    finally:
        watch.close()
    assert_every_turn_announced_once(stack, task.pvc)
    assert len(recoveries(stack, task.name, task.uid)) == 1
    stack.kubectl("delete", "ctask", task.name, timeout=120)


def test_one_agent_killed_in_a_running_daemon_is_resumed_and_the_others_untouched(
    stack: DevStack, tmp_path: Path
) -> None:
    task = start_task(stack, "oom")
    victim = stack.agent_dirs("default", task.pvc)[0].name
    others = {
        d.name: worker_of(stack, task.pvc, d.name).pid
        for d in stack.agent_dirs("default", task.pvc)
        if d.name != victim
    }
    worker = worker_of(stack, task.pvc, victim)
    watch = PhaseWatch(stack, task.name, tmp_path)
    try:
        os.kill(worker.pid, signal.SIGKILL)  # what the OOM killer does
        wait_until(lambda: gone(worker), 30, "the killed worker to go")
        saved = {victim: saved_turns(stack, task.pvc)[victim]}
        wait_recovered(stack, task, saved, watch)
    finally:
        watch.close()
    assert_every_turn_announced_once(stack, task.pvc)
    assert len(recoveries(stack, task.name, task.uid)) == 1
    still = {name: worker_of(stack, task.pvc, name).pid for name in others}
    assert still == others  # the agents that kept running were never restarted
    stack.kubectl("delete", "ctask", task.name, timeout=120)


def test_an_agent_a_user_killed_stays_stopped(stack: DevStack) -> None:
    task = start_task(stack, "killed-on-purpose")
    victim = stack.agent_dirs("default", task.pvc)[0].name
    argv = daemon_of(stack, task.pvc).cmdline()
    control = argv[argv.index("--socket") + 1]
    killed = subprocess.run(
        [*DRAINCTL, "agents", "--socket", control, "kill", victim],
        capture_output=True, text=True, env=stack.env, timeout=60, check=False,
    )  # fmt: skip
    assert killed.returncode == 0, killed.stderr
    wait_until(
        lambda: {c["type"]: c for c in stack.status("default", task.name).get("conditions") or []}
        .get("AgentsAvailable", {}).get("message", "").startswith(f"{AGENTS - 1} of {AGENTS}"),
        60, "the status to count the killed agent out",
    )  # fmt: skip
    # Several reconcile passes (0.5 s in this stack) and heartbeats (2 s) later, still:
    time.sleep(5)
    assert recoveries(stack, task.name, task.uid) == []
    assert stack.status("default", task.name)["phase"] == "Running"
    stack.kubectl("delete", "ctask", task.name, timeout=120)


def test_an_eviction_during_a_deletion_drain_still_ends_with_one_checkpoint(
    stack: DevStack,
) -> None:
    task = start_task(stack, "evicted-deleting", model=SLOW_TURNS)
    daemon = daemon_of(stack, task.pvc)
    stack.kubectl("delete", "ctask", task.name, "--wait=false")
    stack.wait_phase("default", task.name, "Draining", timeout=30)
    daemon.send_signal(signal.SIGTERM)
    wait_until(lambda: stack.task("default", task.name) is None, 180, "the task to be gone")
    checkpoints = [c for c in stack.ledger.list_checkpoints(namespace="default", name=task.name)
                   if c.task_uid == task.uid]  # fmt: skip
    assert len(checkpoints) == 1
    [checkpoint] = checkpoints
    assert not checkpoint.forced
    assert {a.agent_id: a.turns for a in checkpoint.agents} == saved_turns(stack, task.pvc)
    assert recoveries(stack, task.name, task.uid) == []
    assert_every_turn_announced_once(stack, task.pvc)


def test_an_eviction_during_a_pause_still_suspends_with_its_checkpoint_and_wakes(
    stack: DevStack, tmp_path: Path
) -> None:
    task = start_task(stack, "evicted-pausing", model=SLOW_TURNS)
    daemon = daemon_of(stack, task.pvc)
    guard = f"{task.name}-drain-guard"
    # A PodDisruptionBudget of no pod's, so the watch has a first line to wait for.
    sentinel = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "watch-sentinel", "namespace": "default"},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "none"}}},
    }
    assert stack.apply(sentinel).returncode == 0  # fmt: skip
    budgets = Watch(stack, tmp_path, "pdb", "--output-watch-events")  # EVENT NAME … rows
    stack.kubectl("patch", "ctask", task.name, "--type", "merge", "-p",
                  '{"spec": {"lifecycle": {"suspend": true}}}')  # fmt: skip
    stack.wait_phase("default", task.name, "Draining", timeout=30)
    daemon.send_signal(signal.SIGTERM)
    stack.wait_phase("default", task.name, "Suspended", timeout=180)

    # The drain guard (a PodDisruptionBudget) existed while the pause was on its way,
    # so a voluntary eviction would have waited; it is gone once the pause is done.
    def guard_events() -> list[str]:
        rows = [line.split() for line in budgets.lines()]
        return [row[0] for row in rows if len(row) > 1 and row[1] == guard]

    wait_until(lambda: "DELETED" in guard_events(), 30, "the drain guard to go")
    budgets.close()
    assert guard_events() == ["ADDED", "DELETED"]
    assert stack.kubectl("get", "pdb", guard, check=False).returncode != 0
    stack.kubectl("delete", "pdb", "watch-sentinel")
    ref = stack.status("default", task.name)["checkpointRef"]
    checkpoint = stack.ledger.get_checkpoint(ref)
    assert checkpoint is not None and checkpoint.verified
    paused = saved_turns(stack, task.pvc)
    assert {a.agent_id: a.turns for a in checkpoint.agents} == paused
    pauses = [op for op in stack.ledger.list_operations(namespace="default", name=task.name)
              if op.kind == OperationKind.PAUSE]  # fmt: skip
    assert len(pauses) == 1
    stack.kubectl("patch", "ctask", task.name, "--type", "merge", "-p",
                  '{"spec": {"lifecycle": {"suspend": false}}}')  # fmt: skip
    stack.wait_phase("default", task.name, "Running", timeout=90)
    wait_until(lambda: all(saved_turns(stack, task.pvc)[a] > t for a, t in paused.items()),
               60, "every agent to continue after the wake")  # fmt: skip
    assert recoveries(stack, task.name, task.uid) == []
    assert_every_turn_announced_once(stack, task.pvc)
    stack.kubectl("delete", "ctask", task.name, timeout=120)
