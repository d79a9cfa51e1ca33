"""Scenario ``wake``: a suspended N-agent CalibanTask woken until phase ``Running``, and
where the time goes.

``drainctl dev up`` (embedded Kubernetes API, kopf operator, orchestrator worker,
stand-in Sandbox controller, each with the dev stack's own defaults) on Redis and a
SQLite ledger, every process logging JSON. One task with N scripted agents is created
and brought to ``Running`` with a turn from every agent (untimed). Each repetition
pauses it (``spec.lifecycle.suspend: true`` → ``Suspended``, its pod gone; untimed),
then wakes it as ``drainctl wake`` does (one merge patch: the wake annotation and
``suspend: false``, through the Kubernetes client so no process start-up is counted)
and times until a GET answers ``Running``; it then waits until every agent has
announced turn ``turns + 1`` of the checkpoint it was paused at.

Where the time goes is read from timestamps the system wrote, each taken against the
wake request: the resume operation's ``created_at`` in the ledger (the operator's first
action, right after it unsuspends the Sandbox), the stand-in's ``sandbox_pod_started``
log line, the daemon's ``daemon_ready`` and first and last ``agent_resumed`` lines in the
pod's log, each worker's ``resumed_from`` record and ``TurnEnd`` of turn ``turns + 1``
in its transcript, and the operation's ``finished_at``. Correctness: one resume
operation per wake, every agent resumed from ``turns + 1`` of the checkpoint, and its
transcript announcing turns 1…k once each (nothing lost, nothing repeated).
"""

from __future__ import annotations

import contextlib
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
from kubernetes import client, config

from bench.recovery import announced_in_order
from bench.report import Check, Scenario, median, ms, ms_list, percentile
from bench.resume import completed_at, events
from orchestrator.ledger import Ledger, OperationKind
from orchestrator.operator.crd import GROUP, PLURAL, VERSION, WAKE_ANNOTATION, sandbox_name
from orchestrator.testing import DevStackProcess, flushed_redis, fresh_ledger, pipeline_env
from worker_agent import layout, transcript
from worker_agent.children import descendants
from worker_agent.session import load_session
from worker_agent.testing import wait_until

AGENTS, QUICK_AGENTS, MODEL = 10, 3, "turns=100000,turn_ms=50"
REDIS_DB = 12
NAME = "bench-wake"
MILESTONES = (
    ("resume operation created in the ledger (the operator's first action)", "operation"),
    ("pod started by the Sandbox stand-in", "pod"),
    ("daemon ready in the pod", "daemon"),
    ("first agent resumed by the daemon", "first_resumed"),
    ("last agent resumed by the daemon", "last_resumed"),
    ("every worker running (its `resumed` event)", "workers"),
    ("resume operation finished in the ledger", "finished"),
    ("status `Running` seen by a GET", "running"),
    ("every agent's turn `turns + 1` complete", "next_turn"),
)


def log_times(path: Path, after: float, message: str) -> list[float]:
    """Wall-clock times of the JSON log lines of ``path`` whose message starts with
    ``message``, written after ``after``."""
    found: list[float] = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return found
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not str(entry.get("message", "")).startswith(message):
            continue
        stamp = datetime.fromisoformat(str(entry["ts"]).replace("Z", "+00:00")).timestamp()
        if stamp >= after:
            found.append(stamp)
    return found


def stack_setting(stack: DevStackProcess, name: str) -> str | None:
    """The value of ``name`` in the environment of the dev stack's processes (the
    operator's settings are what ``drainctl dev up`` gives its children)."""
    for pid in descendants(stack.pid):
        with contextlib.suppress(psutil.Error):
            value = psutil.Process(pid).environ().get(name)
            if value is not None:
                return value
    return None


def wall(moment: datetime | None) -> float | None:
    """A ledger time as wall-clock seconds (SQLite hands it back without its zone: UTC)."""
    if moment is None:
        return None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


class Waker:
    def __init__(self, stack: DevStackProcess, ledger: Ledger, agents: int) -> None:
        self.agents = agents
        config.load_kube_config(config_file=str(stack.kubeconfig))
        self.api = client.CustomObjectsApi()
        self.stack = stack
        self.ledger = ledger
        self.sandbox = sandbox_name(NAME)
        self.key = f"sandbox=default/{self.sandbox}"
        """How the stand-in's log lines name the task's Sandbox."""
        self.pod_log = stack.state / "sandboxes" / "logs" / f"default.{self.sandbox}.log"
        self.problems: list[str] = []
        self.continued = 0

    def get(self) -> dict[str, Any]:
        got: dict[str, Any] = self.api.get_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL, NAME
        )
        return got

    def phase(self) -> str | None:
        return (self.get().get("status") or {}).get("phase")

    def patch(self, body: dict[str, Any]) -> None:
        self.api.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, NAME, body)

    def volume(self) -> Path:
        pvc = str(self.get()["status"]["pvcName"])
        return self.stack.state / "sandboxes" / "volumes" / "default" / pvc

    def agent_dirs(self) -> list[Path]:
        agents = layout.agents_dir(self.volume())
        return sorted(d for d in agents.iterdir() if d.is_dir()) if agents.is_dir() else []

    def create(self) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "CalibanTask",
            "metadata": {"name": NAME, "namespace": "default"},
            "spec": {"task": {"agents": self.agents, "model": MODEL}},
        }
        self.api.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)
        wait_until(lambda: self.phase() == "Running", 180, f"{NAME} Running")

        def working() -> bool:
            dirs = self.agent_dirs()
            return len(dirs) == self.agents and all(load_session(d).turns >= 1 for d in dirs
                                               if layout.session_file(d).exists())  # fmt: skip

        wait_until(working, 180, f"{self.agents} agents with a turn each", 0.1)

    def pause(self, rep: int) -> dict[str, int]:
        """Suspend the task and wait until its pod is gone; the checkpoint's turns."""
        self.patch({"spec": {"lifecycle": {"suspend": True}}})
        wait_until(lambda: self.phase() == "Suspended", 180, f"{NAME} Suspended", 0.05)

        def pod_gone() -> bool:
            return len(log_times(self.stack.log, 0, f"sandbox_pod_stopped {self.key}")) > rep

        wait_until(pod_gone, 120, f"the pod of {self.sandbox} to stop", 0.05)
        ref = str(self.get()["status"]["checkpointRef"])
        checkpoint = self.ledger.get_checkpoint(ref)
        assert checkpoint is not None, ref
        return {a.agent_id: a.turns for a in checkpoint.agents}

    def wake(self, paused: dict[str, int]) -> dict[str, float]:
        """Wake the task; each milestone's seconds after the wake request."""
        before = {op.id for op in self.resumes()}
        started = time.time()
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        self.patch({"metadata": {"annotations": {WAKE_ANNOTATION: stamp}},
                    "spec": {"lifecycle": {"suspend": False}}})  # fmt: skip
        while self.phase() != "Running":
            if time.time() - started > 180:
                raise AssertionError(f"{NAME} not Running 180 s after the wake")
            time.sleep(0.005)
        running = time.time() - started
        dirs = {d.name: d for d in self.agent_dirs()}

        def continued() -> bool:
            return all(
                load_session(dirs[a]).turns > turns for a, turns in paused.items() if a in dirs
            )

        wait_until(continued, 120, "every agent past its checkpoint", 0.05)
        op = wait_until(lambda: self.finished_resume(before), 60, "the resume operation", 0.05)
        times: dict[str, float | None] = {
            "operation": wall(op.created_at),
            "finished": wall(op.finished_at),
            "running": started + running,
        }
        pods = log_times(self.stack.log, started, f"sandbox_pod_started {self.key}")
        times["pod"] = min(pods, default=None)
        ready = log_times(self.pod_log, started, "daemon_ready")
        times["daemon"] = min(ready, default=None)
        resumed = log_times(self.pod_log, started, "agent_resumed")
        times["first_resumed"] = min(resumed, default=None)
        times["last_resumed"] = max(resumed, default=None)
        workers, turns = [], []
        for agent, turns_at_pause in paused.items():
            directory = dirs.get(agent)
            if directory is None:
                self.problems.append(f"agent {agent} of the checkpoint has no directory")
                continue
            froms = [(transcript.resumed_from(e), transcript.stamp(e) or 0.0)
                     for e in events(directory)
                     if transcript.resumed_from(e) is not None
                     and (transcript.stamp(e) or 0.0) >= started]  # fmt: skip
            done = completed_at(directory, turns_at_pause + 1)
            if [f for f, _ in froms] != [turns_at_pause + 1] or done is None:
                self.problems.append(f"agent {agent}: resumed {froms} after {turns_at_pause}")
                continue
            if not announced_in_order(directory):
                self.problems.append(f"agent {agent}: turns lost or repeated")
                continue
            self.continued += 1
            workers.append(froms[0][1])
            turns.append(done)
        times["workers"] = max(workers, default=None)
        times["next_turn"] = max(turns, default=None)
        missing = [k for k, v in times.items() if v is None]
        if missing:
            self.problems.append(f"no timestamp for {missing}")
        return {k: v - started for k, v in times.items() if v is not None}

    def resumes(self) -> list[Any]:
        return [op for op in self.ledger.list_operations(namespace="default", name=NAME)
                if op.kind is OperationKind.RESUME]  # fmt: skip

    def finished_resume(self, before: set[str]) -> Any:
        new = [op for op in self.resumes() if op.id not in before]
        if len(new) > 1:
            self.problems.append(f"{len(new)} resume operations for one wake")
        return new[0] if new and new[0].finished_at is not None else None


def run(quick: bool, root: Path, redis_port: int) -> Scenario:
    repeat, agents = (1, QUICK_AGENTS) if quick else (7, AGENTS)
    broker = flushed_redis(redis_port, REDIS_DB)
    database = fresh_ledger(f"sqlite:///{root / 'ledger.db'}")
    (root / "stack").mkdir()
    stack = DevStackProcess(
        root / "stack", env=pipeline_env(broker, database, DRAIN_LOG_FORMAT="json")
    )
    ledger = Ledger.from_url(database)
    wakes: list[dict[str, float]] = []
    try:
        stack.start(120)
        waker = Waker(stack, ledger, agents)
        interval = stack_setting(stack, "DRAIN_RECONCILE_INTERVAL_SECS")
        waker.create()
        for rep in range(repeat):
            paused = waker.pause(rep)
            wakes.append(waker.wake(paused))
            print(f"  wake rep {rep + 1}/{repeat}: Running after {ms(wakes[-1]['running'])} ms")
    finally:
        ledger.dispose()
        stack.stop(120)
    series = {key: [w[key] for w in wakes if key in w] for _, key in MILESTONES}
    table = [
        (f"wake request → {label} (median / p95)",
         f"{ms(median(series[key]))} / {ms(percentile(series[key], 0.95))} ms")
        for label, key in MILESTONES
    ]  # fmt: skip
    return Scenario(
        name="wake",
        title=f"Wake of a suspended {agents}-agent CalibanTask → Running, end to end",
        setup=[
            "Path: wake patch (annotation + `suspend: false`, as `drainctl wake`) → operator "
            "(its next pass) unsuspends the Sandbox and starts the resume operation → the "
            "stand-in starts the pod → daemon and its consumer → resume of the checkpoint's "
            "agents → heartbeat → operator: `Running`.",
            f"{agents} scripted agents `model={MODEL!r}`; {repeat} repetition(s) of pause "
            f"(untimed) then wake; the dev stack's default timing "
            f"(DRAIN_RECONCILE_INTERVAL_SECS={interval or 'unset'} in its processes' "
            "environment); the first milestone includes any wait for the operator's next pass.",
            "Every figure is a milestone's time after the wake request, from timestamps the "
            "system wrote (ledger rows, JSON log lines, the workers' transcripts); `Running` "
            "is when a GET polled every 5 ms first answered it.",
        ],
        table=table,
        checks=[
            Check(
                "every wake: one resume operation, every agent continued at turns + 1, no "
                "turn lost or repeated",
                not waker.problems and waker.continued == agents * repeat,
                "; ".join(waker.problems)
                or f"{waker.continued} of {agents * repeat} agents continued over {repeat} wakes",
                budget=False,
            )
        ],
        runs=[f"{label}: {ms_list(series[key])}" for label, key in MILESTONES if series[key]],
        data={"wakes": wakes, "problems": waker.problems, "reconcile_interval_secs": interval},
    )
