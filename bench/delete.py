"""Scenario ``delete``: delete → gone for a 10-agent CalibanTask, end to end.

``drainctl dev up`` (embedded Kubernetes API, kopf operator, orchestrator worker,
stand-in Sandbox controller) on Redis and a SQLite ledger. Each repetition creates a
task with N scripted agents, waits for ``Running`` and a turn from every agent, and times
the DELETE until a GET answers 404 (finalizer released), through the Kubernetes client so
no kubectl start-up is counted; the checkpoint is audited against the files. Budget:
≤ 1.5 x (N bare processes + the no-op chain + 3 API round trips), measured in the run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from bench import floors
from bench.audit import Audit
from bench.report import Check, Scenario, at_most, median, ms, ms_list
from orchestrator.ledger import Ledger
from orchestrator.operator.crd import GROUP, PLURAL, VERSION
from orchestrator.testing import DevStackProcess, flushed_redis, fresh_ledger, pipeline_env
from worker_agent import layout
from worker_agent.session import count_completed_turns
from worker_agent.testing import wait_until

AGENTS, MODEL = 10, "turns=100000,turn_ms=50"
BUDGET = 1.5
REDIS_DB = 15
"""A database of its own, so it can run beside the other scenarios (``--jobs``)."""


class Deleter:
    def __init__(self, stack: DevStackProcess, ledger: Ledger) -> None:
        config.load_kube_config(config_file=str(stack.kubeconfig))
        self.api = client.CustomObjectsApi()
        self.stack = stack
        self.ledger = ledger
        self.snapshots: list[float] = []
        """Per deletion: checkpoint recorded → its VolumeSnapshot cut (part of the path)."""

    def get(self, name: str) -> dict[str, Any]:
        got: dict[str, Any] = self.api.get_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL, name
        )
        return got

    def status(self, name: str) -> dict[str, Any]:
        status: dict[str, Any] = self.get(name).get("status") or {}
        return status

    def round_trip(self) -> object:
        return self.api.list_namespaced_custom_object(GROUP, VERSION, "default", PLURAL)

    def once(self, name: str, audit: Audit) -> float:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "CalibanTask",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"task": {"agents": AGENTS, "model": MODEL}},
        }
        self.api.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)
        wait_until(lambda: self.status(name).get("phase") == "Running", 180, f"{name} Running")
        pvc = str(self.status(name)["pvcName"])
        volume = self.stack.state / "sandboxes" / "volumes" / "default" / pvc

        def all_working() -> bool:
            agents = layout.agents_dir(volume)
            dirs = list(agents.iterdir()) if agents.is_dir() else []
            return len(dirs) == AGENTS and all(count_completed_turns(d) >= 1 for d in dirs)

        wait_until(all_working, 180, f"{AGENTS} agents with a turn each", 0.1)
        started = time.perf_counter()
        self.api.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, name)
        while time.perf_counter() - started < 240:  # gone: the finalizer was released
            try:
                self.get(name)
            except ApiException as exc:
                if exc.status == 404:
                    break
                raise
            time.sleep(0.005)
        secs = time.perf_counter() - started
        checkpoint = self.ledger.latest_checkpoint("default", name)
        if checkpoint is None or len(checkpoint.agents) != AGENTS or not checkpoint.verified:
            audit.problems.append(f"{name}: checkpoint {checkpoint}")
        elif checkpoint.snapshot_cut_at is None:
            audit.problems.append(f"{name}: checkpoint {checkpoint.ref} has no cut snapshot")
        else:
            cut = checkpoint.snapshot_cut_at - checkpoint.created_at
            self.snapshots.append(max(cut.total_seconds(), 0.0))
        for agent in checkpoint.agents if checkpoint else ():
            audit.agent(
                f"{name}/{agent.agent_id}",
                volume / agent.session_dir,
                agent.turns,
                agent.session_sha256,
                agent.clean,
            )
        return secs


def run(quick: bool, root: Path, redis_port: int) -> Scenario:
    repeat = 1 if quick else 7
    broker = flushed_redis(redis_port, REDIS_DB)
    database = fresh_ledger(f"sqlite:///{root / 'ledger.db'}")
    stack = DevStackProcess(root, env=pipeline_env(broker, database))
    noop = floors.NoopChain(root, broker)
    ledger = Ledger.from_url(database)
    audit = Audit()
    try:
        stack.start(120)
        noop.start()
        deleter = Deleter(stack, ledger)
        deletes, agents, chains, apis = [], [], [], []
        for rep in range(repeat):
            deletes.append(deleter.once(f"bench-{rep}", audit))
            agents.append(floors.bare_processes(AGENTS))
            chains.append(noop.measure())
            apis.append(floors.round_trips(deleter.round_trip, 3))
            print(f"  delete rep {rep + 1}/{repeat}: {ms(deletes[-1])} ms")
    finally:
        ledger.dispose()
        noop.stop()
        stack.stop(120)
    floor = median(agents) + median(chains) + median(apis)
    ratio = median(deletes) / floor
    return Scenario(
        name="delete",
        title=f"Delete → gone, {AGENTS}-agent CalibanTask, end to end",
        setup=[
            "Path: DELETE → finalizer → drain (daemon queue) → record_checkpoint "
            "(orchestrator queue) → VolumeSnapshot of the workspace until cut (the stand-in "
            "CSI driver copies the volume; it is readyToUse at the cut, a real driver's "
            "minutes later, which the deletion does not wait for) → checkpointRef, PVC "
            "retained → GET answers 404.",
            f"{AGENTS} scripted agents `model={MODEL!r}`; medians of {repeat} repetition(s).",
        ],
        table=[
            ("delete → gone (median)", f"{ms(median(deletes))} ms"),
            (f"floor: {AGENTS} bare processes (median)", f"{ms(median(agents))} ms"),
            ("floor: no-op two-task Celery chain (median)", f"{ms(median(chains))} ms"),
            ("floor: 3 API round trips (median)", f"{ms(median(apis))} ms"),
            ("floor, sum", f"{ms(floor)} ms"),
            ("**ratio**", f"**{ratio:.2f}**"),
            (
                "of delete → gone: checkpoint recorded → snapshot cut (median)",
                f"{ms(median(deleter.snapshots))} ms" if deleter.snapshots else "-",
            ),
        ],
        checks=[
            at_most("delete → gone / floor", ratio, BUDGET),
            Check(
                "every deletion left one verified checkpoint matching the files",
                audit.ok,
                audit.summary(),
                budget=False,
            ),
        ],
        runs=[
            f"delete {ms_list(deletes)}; bare processes {ms_list(agents)}; chain "
            f"{ms_list(chains)}; 3 API round trips {ms_list(apis)}"
        ],
        data={
            "deletes": deletes,
            "agents": agents,
            "chains": chains,
            "apis": apis,
            "snapshots": deleter.snapshots,
            "audit": audit.__dict__,
        },
    )
