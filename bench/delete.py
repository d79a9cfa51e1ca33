"""Delete → gone for a 10-agent CalibanTask, end to end, against a floor of the same run.

``.venv/bin/python bench/delete.py [--agents 10] [--repeat 3] [--write]``

Starts ``drainctl dev up`` (embedded Kubernetes API, kopf operator, orchestrator worker,
stand-in Sandbox controller) on this machine's Redis (a flushed database) and a SQLite
ledger, then for each repetition: ``kubectl apply`` a task with N scripted agents mid
turns, waits for Running and a turn from every agent, and times the deletion
from the DELETE request until a GET answers 404 (the finalizer released, the object
gone), through the Kubernetes client so no kubectl start-up is counted. Each deletion is
checked: one recorded checkpoint whose turns equal the turns on disk.

The floor, measured in the same run: N bare processes that flush a session file on
SIGTERM and exit (``bench/drain.py``'s floor) plus a no-op two-task Celery chain on the
same broker (``bench/pipeline.py``'s). Budget (docs/architecture.md, "Performance
budgets"): at most 2 x floor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import drain as drain_bench  # bench/drain.py (this script's folder is on sys.path)
import pipeline as pipeline_bench  # bench/pipeline.py
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from orchestrator.ledger import Ledger
from orchestrator.operator import crd
from orchestrator.settings import Settings
from worker_agent.session import count_completed_turns, load_session

BUDGET = 2.0
BEGIN = "<!-- bench/delete.py results: begin -->"
END = "<!-- bench/delete.py results: end -->"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), *args],
        capture_output=True, text=True, input=stdin, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise drain_bench.BenchFailure(f"kubectl {' '.join(args)}: {done.stderr}")
    return done.stdout


def status(kubeconfig: Path, name: str) -> dict[str, object]:
    out = kubectl(kubeconfig, "get", "ctask", name, "-o", "json")
    loaded: dict[str, object] = json.loads(out).get("status") or {}
    return loaded


def one_delete(root: Path, kubeconfig: Path, ledger: Ledger, agents: int, rep: int) -> float:
    name = f"bench-{rep}"
    manifest = {
        "apiVersion": crd.API_VERSION,
        "kind": crd.KIND,
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"task": {"agents": agents, "model": "turns=100000,turn_ms=50"}},
    }
    kubectl(kubeconfig, "apply", "-f", "-", stdin=yaml.safe_dump(manifest))
    drain_bench.wait_until(
        lambda: status(kubeconfig, name).get("phase") == "Running", 180, f"{name} Running"
    )
    pvc = str(status(kubeconfig, name)["pvcName"])
    volume = root / "state" / "sandboxes" / "volumes" / "default" / pvc / "agents"

    def all_working() -> bool:
        dirs = list(volume.iterdir()) if volume.is_dir() else []
        return len(dirs) == agents and all(count_completed_turns(d) >= 1 for d in dirs)

    drain_bench.wait_until(all_working, 180, f"{agents} agents with a turn each")
    api = client.CustomObjectsApi()
    started = time.perf_counter()
    api.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, "default", crd.PLURAL, name)
    while True:  # gone = the finalizer was released and the object removed
        try:
            api.get_namespaced_custom_object(crd.GROUP, crd.VERSION, "default", crd.PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                break
            raise
        if time.perf_counter() - started > 240:
            raise drain_bench.BenchFailure(f"{name} not gone after 240 s")
        time.sleep(0.005)
    secs = time.perf_counter() - started
    checkpoint = ledger.latest_checkpoint("default", name)
    if checkpoint is None or len(checkpoint.agents) != agents or not checkpoint.verified:
        raise drain_bench.BenchFailure(f"{name}: checkpoint {checkpoint}")
    for agent in checkpoint.agents:
        directory = volume / agent.agent_id
        on_disk = load_session(directory).turns
        if not agent.turns == on_disk == count_completed_turns(directory):
            raise drain_bench.BenchFailure(f"{name}/{agent.agent_id}: lost turns")
    return secs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cd-del-", dir="/tmp"))
    broker = pipeline_bench.flushed_redis(13)
    database = f"sqlite:///{root / 'ledger.db'}"
    env = {**os.environ, "DRAIN_BROKER_URL": broker, "DRAIN_RESULT_BACKEND": broker,
           "DRAIN_DATABASE_URL": database, "DRAIN_RECONCILE_INTERVAL_SECS": "0.5"}  # fmt: skip
    kubeconfig = root / "kubeconfig.yaml"
    with (root / "dev-up.log").open("ab") as out:
        stack = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "dev", "up", "--kubeconfig",
             str(kubeconfig), "--state-dir", str(root / "state")],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    noop_worker = pipeline_bench.start_noop_worker(root, env)
    ledger = Ledger.from_url(database)
    try:
        drain_bench.wait_until(kubeconfig.exists, 120, "dev up")
        time.sleep(1)
        config.load_kube_config(config_file=str(kubeconfig))
        deletes = [one_delete(root, kubeconfig, ledger, args.agents, r) for r in range(args.repeat)]
        app = pipeline_bench.noop_app(Settings(broker_url=broker, result_backend=broker))
        pipeline_bench.measure_noop_chain(app, -1)  # warm-up
        chains = [pipeline_bench.measure_noop_chain(app, r) for r in range(args.repeat)]
        floors = [drain_bench.measure_floor(args.agents).secs for _ in range(args.repeat)]
    finally:
        ledger.dispose()
        stack.send_signal(signal.SIGTERM)
        stack.wait(120)
        pipeline_bench.stop_popen(noop_worker, 30)
        shutil.rmtree(root, ignore_errors=True)
    delete_ms = statistics.median(deletes) * 1000
    floor_ms = (statistics.median(floors) + statistics.median(chains)) * 1000
    ratio = delete_ms / floor_ms
    verdict = "PASS" if ratio <= BUDGET else "FAIL"
    section = "\n".join(
        [
            BEGIN,
            "## Delete → gone, 10-agent task, end to end",
            "",
            f"- Command: `.venv/bin/python bench/delete.py --agents {args.agents} "
            f"--repeat {args.repeat} --write`",
            f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            f"machine: {pipeline_bench.machine()}",
            "- Path: DELETE (Kubernetes client; until GET answers 404) → finalizer → drain "
            "(daemon queue) → "
            "record_checkpoint (orchestrator queue) → checkpointRef, PVC retained → gone",
            "",
            "| agents | delete → gone ms (median) | agent floor ms | no-op chain ms | "
            "floor ms | ratio | budget ≤ 2 |",
            "|---:|---:|---:|---:|---:|---:|---|",
            f"| {args.agents} | {delete_ms:.0f} | {statistics.median(floors) * 1000:.0f} | "
            f"{statistics.median(chains) * 1000:.0f} | {floor_ms:.0f} | {ratio:.2f} | {verdict} |",
            "",
            f"Every run: delete {[round(d * 1000) for d in deletes]} ms; agent floor "
            f"{[round(f * 1000) for f in floors]} ms; chain {[round(c * 1000) for c in chains]} ms."
            " Every deletion left one verified checkpoint whose turns equal the files on disk.",
            END,
        ]
    )
    print(section)
    if args.write:
        text = RESULTS.read_text() if RESULTS.exists() else "# Benchmarks\n"
        if BEGIN in text:
            text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
        else:
            text = text.rstrip() + "\n\n" + section + "\n"
        RESULTS.write_text(text)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
