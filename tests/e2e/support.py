"""End-to-end harness: ``drainctl dev up`` as a real subprocess (embedded Kubernetes API,
kopf operator, orchestrator worker, stand-in Sandbox controller), real Redis and
PostgreSQL, and the real ``kubectl`` binary as the user's client."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.ledger import CheckpointView, Ledger
from orchestrator.testing import DevStackProcess
from tests.support import wait_until
from worker_agent import layout
from worker_agent.session import SessionError, load_session
from worker_agent.testing import DRAINCTL

SAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "samples"


class DevStack(DevStackProcess):
    """``drainctl dev up`` from the testing kit, started at once, with kubectl helpers."""

    def __init__(
        self,
        root: Path,
        broker: str | None,
        database: str,
        *extra: str,
        env: dict[str, str] | None = None,
    ) -> None:
        """``broker`` None: the stack's embedded broker; ``env``: more settings."""
        if shutil.which("kubectl") is None:
            pytest.skip("kubectl is not installed")
        brokers = {} if broker is None else {
            "DRAIN_BROKER_URL": broker, "DRAIN_RESULT_BACKEND": broker,
        }  # fmt: skip
        super().__init__(
            root,
            *extra,
            env={
                **brokers,
                "DRAIN_DATABASE_URL": database,
                "DRAIN_RECONCILE_INTERVAL_SECS": "0.5",
                "DRAIN_HEARTBEAT_INTERVAL_SECS": "2",
                "DRAIN_HEARTBEAT_POLL_SECS": "0.2",
                "DRAIN_VISIBILITY_TIMEOUT_SECS": "10",
                "DRAIN_UNACKED_RESTORE_INTERVAL_SECS": "1",
                "DRAIN_SWEEP_INTERVAL_SECS": "1",
                **(env or {}),
            },
        )
        self.database_url = database
        self.ledger = Ledger.from_url(database)
        self.start()

    def kubectl(
        self, *args: str, check: bool = True, stdin: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["kubectl", "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True, text=True, timeout=timeout, input=stdin, check=False,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def apply(self, manifest: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest), check=False)

    def task(self, namespace: str, name: str) -> dict[str, Any] | None:
        got = self.kubectl("get", "ctask", name, "-n", namespace, "-o", "json", check=False)
        if got.returncode != 0:
            return None
        loaded: dict[str, Any] = json.loads(got.stdout)
        return loaded

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        task = self.task(namespace, name)
        return dict((task or {}).get("status") or {})

    def wait_phase(self, namespace: str, name: str, phase: str, timeout: float = 90) -> None:
        wait_until(
            lambda: self.status(namespace, name).get("phase") == phase,
            timeout,
            f"{namespace}/{name} to reach phase {phase} (now {self.status(namespace, name)})",
        )

    def sandbox_field(
        self, name: str, jsonpath: str, *, version: str, namespace: str = "default"
    ) -> str:
        """``kubectl get sandboxes.<version>.agents.x-k8s.io <name> -o jsonpath=…``: the
        Sandbox read at ``version`` (``v1alpha1`` or ``v1beta1``), as a user reads it."""
        return self.kubectl(
            "get", f"sandboxes.{version}.agents.x-k8s.io", name, "-n", namespace,
            "-o", f"jsonpath={jsonpath}",
        ).stdout  # fmt: skip

    def task_sandbox_version(self, name: str, namespace: str = "default") -> str:
        """The Sandbox version task ``name`` talks to its Sandbox in (``v1beta1`` or
        ``v1alpha1``), as pinned in its ``status.sandboxApiVersion``."""
        pinned = wait_until(
            lambda: self.status(namespace, name).get("sandboxApiVersion"), 60,
            f"{namespace}/{name}'s status.sandboxApiVersion",
        )  # fmt: skip
        return str(pinned).rpartition("/")[2]

    def watch_passes(self, name: str, passes: int, namespace: str = "default") -> None:
        """``passes`` reconcile passes over the task, each awaited by its
        observedGeneration: each edits a field that changes nothing a task at rest runs
        (the drain grace period), which bumps ``metadata.generation``, and the operator
        writes the generation it saw only from a pass over the object."""
        for n in range(passes):
            task = self.task(namespace, name) or {}
            grace = f"{31 + int(task.get('metadata', {}).get('generation') or 0)}s"
            body = json.dumps({"spec": {"lifecycle": {"drainGracePeriod": grace}}})
            self.kubectl("patch", "ctask", name, "-n", namespace, "--type=merge", "-p", body)

            def observed(grace: str = grace) -> bool:
                task = self.task(namespace, name) or {}
                generation = task.get("metadata", {}).get("generation")
                return (
                    bool(generation)
                    and task.get("status", {}).get("observedGeneration") == generation
                    and task["spec"]["lifecycle"]["drainGracePeriod"] == grace
                )

            wait_until(observed, 60, f"{name}: a reconcile pass observing edit {n + 1}")

    def volume(self, namespace: str, pvc: str) -> Path:
        return self.state / "sandboxes" / "volumes" / namespace / pvc

    def agent_dirs(self, namespace: str, pvc: str) -> list[Path]:
        agents = layout.agents_dir(self.volume(namespace, pvc))
        return sorted(p for p in agents.iterdir() if p.is_dir()) if agents.is_dir() else []

    def pvc_of(self, name: str, namespace: str = "default") -> str:
        """The task's workspace PVC, once the operator has provisioned it."""
        found = wait_until(lambda: self.status(namespace, name).get("pvcName"), 60, "a PVC")
        return str(found)

    def turns_on_disk(self, pvc: str, namespace: str = "default") -> dict[str, int]:
        """Completed turns of each agent whose session is on the PVC's volume."""
        return {d.name: load_session(d).turns for d in self.agent_dirs(namespace, pvc)
                if layout.session_file(d).exists()}  # fmt: skip

    def wait_turns(self, pvc: str, count: int, at_least: int, namespace: str = "default") -> None:
        def enough() -> bool:
            turns = self.turns_on_disk(pvc, namespace)
            return len(turns) == count and all(t >= at_least for t in turns.values())

        wait_until(enough, 90, f"{count} agents in {pvc} with {at_least}+ turns")

    def daemon_pids(self, pvc: str, namespace: str = "default") -> list[int]:
        """The stack's processes serving ``pvc``'s volume as their store (the daemon, and
        the pod's reaper, which carries its argv)."""
        import psutil

        from worker_agent.children import descendants

        volume = str(self.volume(namespace, pvc))
        found = []
        for pid in descendants(self.pid):
            try:
                argv = psutil.Process(pid).cmdline()
            except psutil.Error:
                continue
            if "--store" in argv and argv[argv.index("--store") + 1] == volume:
                found.append(pid)
        return found

    def events_of(self, name: str, namespace: str = "default") -> list[dict[str, str]]:
        listed = self.kubectl("get", "events", "-n", namespace, "-o", "json").stdout
        return [
            {"type": e.get("type", ""), "reason": e.get("reason", ""),
             "message": e.get("message", "")}
            for e in json.loads(listed)["items"]
            if e.get("involvedObject", {}).get("name") == name
        ]  # fmt: skip

    def snapshot(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        got = self.kubectl("get", "volumesnapshot", name, "-n", namespace, "-o", "json",
                           check=False)  # fmt: skip
        if got.returncode != 0:
            return None
        found: dict[str, Any] = json.loads(got.stdout)
        return found

    def snapshot_copy(self, name: str, namespace: str = "default") -> Path:
        """Where the stand-in CSI driver keeps VolumeSnapshot ``name``'s copy."""
        snapshot = self.snapshot(name, namespace)
        assert snapshot is not None, f"no VolumeSnapshot {namespace}/{name}"
        return self.state / "sandboxes" / "snapshots" / str(snapshot["metadata"]["uid"])

    def operator_pid(self) -> int | None:
        import psutil

        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(self.pid).children(recursive=True):
                if "operator" in child.cmdline() and "orchestrator.cli" in child.cmdline():
                    return int(child.pid)
        return None

    def ledger_contradictions(self, settle_secs: float = 60) -> list[str]:
        """What the ledger claims that the stack contradicts, once every operation has
        had ``settle_secs`` to finish: an operation still not terminal, or a checkpoint
        whose agents' turns or session sha256 differ from its workspace on disk.

        A checkpoint is compared only while nothing has run on its workspace since: no
        resume names it, no later checkpoint is of the same PVC, and the ledger does not
        already say its workspace is gone; one whose PVC is deleted is compared with its
        ready snapshot only. A forced checkpoint lists no agents."""
        deadline = time.monotonic() + settle_secs
        while True:
            ops = self.ledger.list_operations(limit=1000)
            unfinished = [op for op in ops if not op.terminal]
            if not unfinished or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        found = [f"operation {op.id} ({op.kind} of {op.namespace}/{op.name}) is still "
                 f"{op.state}" for op in unfinished]  # fmt: skip
        resumed = {op.checkpoint_ref for op in ops if op.checkpoint_ref and not
                   op.kind.records_checkpoint}  # fmt: skip
        checkpoints = self.ledger.list_checkpoints(limit=1000)  # newest first
        found += self.snapshot_contradictions(checkpoints)
        newest_of_pvc: dict[tuple[str, str | None], str] = {}
        for checkpoint in checkpoints:
            newest_of_pvc.setdefault((checkpoint.namespace, checkpoint.pvc_name), checkpoint.ref)
        for checkpoint in checkpoints:
            if (
                checkpoint.ref in resumed
                or not checkpoint.available
                or checkpoint.pvc_name is None
                or newest_of_pvc[(checkpoint.namespace, checkpoint.pvc_name)] != checkpoint.ref
            ):
                continue
            volume = self.volume(checkpoint.namespace, checkpoint.pvc_name)
            if checkpoint.snapshot is not None and not volume.exists():
                continue  # its PVC deleted: its ready snapshot holds it (checked above)
            for agent in checkpoint.agents:
                try:
                    session = load_session(volume / agent.session_dir)
                except (OSError, SessionError) as exc:
                    found.append(f"checkpoint {checkpoint.ref} agent {agent.agent_id}: {exc}")
                    continue
                if (session.turns, session.sha256) != (agent.turns, agent.session_sha256):
                    found.append(
                        f"checkpoint {checkpoint.ref} agent {agent.agent_id} records "
                        f"{agent.turns} turns, its workspace holds {session.turns}"
                    )
        return found

    def snapshot_contradictions(self, checkpoints: list[CheckpointView]) -> list[str]:
        """A checkpoint the ledger says has a ready snapshot must have one, holding
        exactly the turns and sha256 it recorded, whatever ran since: a snapshot is
        immutable."""
        found = []
        for checkpoint in checkpoints:
            if checkpoint.snapshot is None or not checkpoint.available:
                continue
            if self.snapshot(checkpoint.snapshot, checkpoint.namespace) is None:
                found.append(f"checkpoint {checkpoint.ref}: VolumeSnapshot "
                             f"{checkpoint.snapshot} is gone")  # fmt: skip
                continue
            copy = self.snapshot_copy(checkpoint.snapshot, checkpoint.namespace)
            for agent in checkpoint.agents:
                try:
                    session = load_session(copy / agent.session_dir)
                except (OSError, SessionError) as exc:
                    found.append(f"checkpoint {checkpoint.ref} snapshot: {exc}")
                    continue
                if (session.turns, session.sha256) != (agent.turns, agent.session_sha256):
                    found.append(
                        f"checkpoint {checkpoint.ref} agent {agent.agent_id} records "
                        f"{agent.turns} turns, its snapshot holds {session.turns}"
                    )
        return found

    def audit(self, *args: str) -> dict[str, Any]:
        """``drainctl audit --json`` against this stack (its API, ledger, settings and
        stand-in volumes), as a user runs it: the report, whatever the exit code says;
        the exit code is checked against it."""
        result = subprocess.run(
            [*DRAINCTL, "audit", "--json", "--volumes", str(self.state / "sandboxes"), *args],
            capture_output=True, text=True, timeout=300, check=False,
            env={**self.env, "KUBECONFIG": str(self.kubeconfig)},
        )  # fmt: skip
        assert result.returncode in (0, 1), f"drainctl audit: {result.stderr}"
        report: dict[str, Any] = json.loads(result.stdout)
        assert (result.returncode == 0) == report["clean"], result.stderr
        return report

    def audit_findings(self) -> list[str]:
        """The one-shot audit's findings, one line each (empty: clean)."""
        return [f"{f['kind']} {f['subject']}: {f['message']}" for f in self.audit()["findings"]]

    def close(self) -> None:
        self.stop(90)
        self.ledger.dispose()


class Watch:
    """``kubectl get … -w`` in the background: every line it printed, in order."""

    def __init__(self, stack: DevStack, root: Path, *args: str) -> None:
        self.out = root / f"watch-{time.monotonic_ns()}.txt"
        argv = ["kubectl", "--kubeconfig", str(stack.kubeconfig), "get", *args, "-w"]
        self._fh = self.out.open("w")
        self._process = subprocess.Popen(argv, stdout=self._fh, stderr=subprocess.DEVNULL)
        # The watch sees what changes from its first line on: disrupt only after it.
        wait_until(self.lines, 30, f"kubectl get {' '.join(args)} -w to print")

    def lines(self) -> list[str]:
        return [line for line in self.out.read_text().splitlines() if line]

    def close(self) -> None:
        self._process.terminate()
        self._process.wait(10)
        self._fh.close()


@contextlib.contextmanager
def embedded_stack(
    prefix: str, *extra: str, env: dict[str, str] | None = None
) -> Iterator[DevStack]:
    """A started :class:`DevStack` on the embedded broker with a SQLite ledger, in a fresh
    directory of /tmp named ``prefix…``, ``extra`` added to ``drainctl dev up``; closed
    afterwards."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    dev = DevStack(root, None, f"sqlite:///{root / 'ledger.db'}", *extra, env=env)
    try:
        yield dev
    finally:
        dev.close()


def task_manifest(
    name: str,
    *,
    namespace: str = "default",
    agents: int = 2,
    model: str = "turns=100000,turn_ms=100",
    **lifecycle: Any,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"task": {"agents": agents, "provider": "scripted", "model": model}}
    if lifecycle:
        spec["lifecycle"] = lifecycle
    return {
        "apiVersion": "caliban.caliban-ai.dev/v1alpha1",
        "kind": "CalibanTask",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }
