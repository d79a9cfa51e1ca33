"""Scenario ``recovery``: how long a disrupted task takes to have every agent working again.

``drainctl dev up`` (embedded Kubernetes API, kopf operator, orchestrator worker,
stand-in Sandbox controller, each with the dev stack's own defaults) on Redis and a
SQLite ledger. Each repetition creates a task with N scripted agents mid-turn, then
disrupts it, alternating an eviction (SIGTERM to the daemon: it drains its agents and
exits) and a node loss (SIGKILL: the agents die with it), and times from the signal
until every agent has saved a turn past the one it had when its pod was gone. The
Sandbox stand-in restarts the pod, the new daemon's heartbeat shows the interrupted
agents, and the operator resumes them through a recorded recovery operation.

The floor, measured in the same run on the same agents: a fresh resume by hand. The
last task's workspace is served by a standalone daemon and every agent is resumed
through its control socket; the floor is from that request until every agent has a new
turn. What the ratio holds beyond it is the disruption's own cost: the daemon's exit,
the pod's restart, the heartbeat, the operator's pass and the Celery round trip.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import psutil
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from bench.report import Check, Scenario, median, ms, ms_list
from orchestrator.devcluster.csi import special_files
from orchestrator.ledger import Ledger
from orchestrator.operator.crd import GROUP, PLURAL, VERSION
from orchestrator.testing import DevStackProcess, flushed_redis, fresh_ledger, pipeline_env
from worker_agent import layout, transcript
from worker_agent.children import descendants
from worker_agent.session import load_session
from worker_agent.testing import DaemonProcess, wait_until

AGENTS, MODEL = 10, "turns=100000,turn_ms=50"
REDIS_DB = 14
DISRUPTIONS = (("eviction (SIGTERM)", signal.SIGTERM), ("node loss (SIGKILL)", signal.SIGKILL))


def saved_turns(volume: Path) -> dict[str, int]:
    agents = layout.agents_dir(volume)
    dirs = sorted(d for d in agents.iterdir() if d.is_dir()) if agents.is_dir() else []
    return {d.name: load_session(d).turns for d in dirs if layout.session_file(d).exists()}


def announced_in_order(directory: Path) -> bool:
    """The transcript announces turns 1…N, each once: nothing lost, nothing repeated."""
    turns = []
    for line in layout.transcript_file(directory).read_bytes().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        turn = transcript.completed_turn(event) if isinstance(event, dict) else None
        if turn is not None:
            turns.append(turn)
    return turns == list(range(1, len(turns) + 1))


def gone(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Disrupter:
    def __init__(self, stack: DevStackProcess, ledger: Ledger) -> None:
        config.load_kube_config(config_file=str(stack.kubeconfig))
        self.api = client.CustomObjectsApi()
        self.stack = stack
        self.ledger = ledger
        self.problems: list[str] = []
        self.turns_checked = 0

    def status(self, name: str) -> dict[str, Any]:
        got = self.api.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, name)
        return dict(got.get("status") or {})

    def volume(self, name: str) -> Path:
        pvc = str(self.status(name)["pvcName"])
        return self.stack.state / "sandboxes" / "volumes" / "default" / pvc

    def daemon(self, volume: Path) -> psutil.Process:
        def find() -> psutil.Process | None:
            for pid in descendants(self.stack.pid):
                try:
                    process = psutil.Process(pid)
                    argv = process.cmdline()
                except psutil.Error:
                    continue
                store = argv[argv.index("--store") + 1] if "--store" in argv else None
                if "daemon" in argv and "worker_agent.reaper" not in argv and store == str(volume):
                    return process
            return None

        return wait_until(find, 60, f"the daemon of {volume.name}", 0.05)

    def once(self, name: str, sig: signal.Signals) -> tuple[float, Path]:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "CalibanTask",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"task": {"agents": AGENTS, "model": MODEL}},
        }
        self.api.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)
        wait_until(lambda: self.status(name).get("phase") == "Running", 180, f"{name} Running")
        volume = self.volume(name)

        def working() -> bool:
            turns = saved_turns(volume)
            return len(turns) == AGENTS and min(turns.values()) >= 2

        wait_until(working, 180, f"{AGENTS} agents working", 0.1)
        uid = str(
            self.api.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, name)[
                "metadata"
            ]["uid"]
        )
        daemon = self.daemon(volume)
        # The daemon and everything under it (its agents, its consumer): a SIGKILLed
        # daemon's agents get SIGTERM (their death signal) and may save the turn they
        # are in before the pod's reaper SIGKILLs them, so the turns they stopped at are
        # read once all of them are gone, not when the daemon is.
        pod = [daemon, *daemon.children(recursive=True)]
        started = time.perf_counter()
        daemon.send_signal(sig)
        wait_until(lambda: all(gone(p) for p in pod), 60, "the disrupted pod to go", 0.005)
        before = saved_turns(volume)

        def continued() -> bool:
            turns = saved_turns(volume)
            return all(turns.get(agent, 0) > saved for agent, saved in before.items())

        wait_until(continued, 180, f"every agent of {name} past {before}", 0.01)
        secs = time.perf_counter() - started
        recoveries = [
            op
            for op in self.ledger.list_operations(namespace="default", name=name)
            if op.task_uid == uid and ":recover:" in op.idempotency_key
        ]
        if len(recoveries) != 1:
            self.problems.append(f"{name}: {len(recoveries)} recovery operations, not 1")
        for directory in sorted(layout.agents_dir(volume).iterdir()):
            self.turns_checked += load_session(directory).turns
            if not announced_in_order(directory):
                self.problems.append(f"{name}/{directory.name}: turns lost or repeated")
        self.api.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, name)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                self.status(name)
            except ApiException as exc:
                if exc.status == 404:
                    break
                raise
            time.sleep(0.05)
        return secs, volume


def fresh_resume(root: Path, store: Path, repeat: int) -> list[float]:
    """The floor: resume every agent of ``store`` by hand on a daemon already up."""
    daemon = DaemonProcess(root)
    # Not a live agent's attach socket, which the stand-in volume still holds.
    shutil.copytree(store, daemon.store, symlinks=True, ignore=special_files)
    floors = []
    for _ in range(repeat):
        daemon.start(60)
        try:
            before = saved_turns(daemon.store)
            started = time.perf_counter()
            with daemon.client() as control:
                for agent in before:
                    control.resume(str(layout.agents_dir(daemon.store) / agent))

            def continued(before: dict[str, int] = before) -> bool:
                turns = saved_turns(daemon.store)
                return all(turns[agent] > saved for agent, saved in before.items())

            wait_until(continued, 120, "every agent past its turns", 0.01)
            floors.append(time.perf_counter() - started)
        finally:
            daemon.stop(60)  # drains: the next repetition resumes them again
    return floors


def run(quick: bool, root: Path, redis_port: int) -> Scenario:
    repeat = 2 if quick else 6
    broker = flushed_redis(redis_port, REDIS_DB)
    database = fresh_ledger(f"sqlite:///{root / 'ledger.db'}")
    stack = DevStackProcess(root / "stack", env=pipeline_env(broker, database))
    (root / "stack").mkdir()
    ledger = Ledger.from_url(database)
    by_kind: dict[str, list[float]] = {label: [] for label, _ in DISRUPTIONS}
    try:
        stack.start(120)
        disrupter = Disrupter(stack, ledger)
        volume = None
        for rep in range(repeat):
            label, sig = DISRUPTIONS[rep % len(DISRUPTIONS)]
            secs, volume = disrupter.once(f"bench-recovery-{rep}", sig)
            by_kind[label].append(secs)
            print(f"  recovery rep {rep + 1}/{repeat} ({label}): {ms(secs)} ms")
    finally:
        ledger.dispose()
        stack.stop(120)
    assert volume is not None
    floor_root = root / "floor"
    floor_root.mkdir()
    floors = fresh_resume(floor_root, volume, max(3, repeat // 2))
    floor = median(floors)
    every = [s for values in by_kind.values() for s in values]
    table = [(f"{label}: signal → every agent past its turns (median)",
              f"{ms(median(values))} ms") for label, values in by_kind.items()]  # fmt: skip
    table += [
        (f"floor: fresh resume of the same {AGENTS} agents by hand (median)", f"{ms(floor)} ms"),
        *((f"**{label} / floor**", f"**{median(v) / floor:.1f}**") for label, v in by_kind.items()),
        ("turns checked on disk (announced 1…N, each once)", str(disrupter.turns_checked)),
    ]
    return Scenario(
        name="recovery",
        title=f"Recovery after a disruption, {AGENTS}-agent CalibanTask, end to end",
        setup=[
            "Path: signal to the daemon → pod restarted by the Sandbox stand-in → heartbeat "
            "with interrupted agents → operator: recovery operation → Celery resume on the "
            "new daemon → every agent saves turn + 1.",
            f"{AGENTS} scripted agents `model={MODEL!r}`; {repeat} repetitions alternating "
            f"the disruptions; the dev stack's default timing (heartbeat poll 0.5 s, "
            f"reconcile 1 s).",
        ],
        table=table,
        checks=[
            Check(
                "every disruption: one recovery operation, every agent continued, no turn "
                "lost or repeated",
                not disrupter.problems,
                "; ".join(disrupter.problems) or f"{len(every)} disruptions, all recovered",
                budget=False,
            )
        ],
        runs=[
            *(f"{label} {ms_list(values)}" for label, values in by_kind.items()),
            f"floor {ms_list(floors)}",
        ],
        data={"by_kind": by_kind, "floors": floors, "problems": disrupter.problems},
    )
