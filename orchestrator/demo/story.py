"""``drainctl demo``: the whole story, on the embedded defaults, through the code paths a
cluster uses.

It starts ``drainctl dev up`` as a child process (the embedded Kubernetes API, the
embedded ``redis://`` broker, a SQLite ledger, the kopf operator, the Celery worker, the
auditor and the stand-in Sandbox controller running real daemons and scripted agents)
and drives one task through its life with the Kubernetes API, as ``kubectl`` would:

1. a CalibanTask with 3 agents is created → Running;
2. its agents finish their work and its ``idleTimeout`` pauses it: drained, checkpointed
   in the ledger, its Sandbox suspended;
3. the wake annotation brings it back: every agent resumes at ``turns + 1``, and a
   prompt to each (through the daemon's attach endpoint) continues the conversation;
4. ``kubectl delete`` → Draining (``status.checkpointRef`` set) → gone, the workspace
   PVC kept;
5. a new task with ``spec.resumeFrom`` continues every agent at ``turns + 1``;
6. ``drainctl audit`` finds nothing wrong.

Every number is read back from the ledger and from the agents' sessions on the volumes,
never from what the demo expects; a completed turn that a later step no longer has is a
lost turn, and the demo exits 1 if there is one. ``--json`` prints the summary instead of
the progress lines.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

from orchestrator.devcluster import csi
from orchestrator.devcluster.up import LEDGER_FILE, SANDBOXES_DIR
from orchestrator.operator import crd
from orchestrator.testing import DevStackProcess
from worker_agent import layout, transcript
from worker_agent.session import SessionError, load_session
from worker_agent.testing import DRAINCTL, ProcessExited, WaitTimeout, wait_until

Echo = Callable[[str], None]

NAMESPACE: Final = "default"
TASK: Final = "demo-story"
RESTORED: Final = "demo-story-restored"
SCRIPTED_TURNS: Final = 3
"""Turns each agent works through before it waits for input (and goes idle)."""
MODEL: Final = f"turns={SCRIPTED_TURNS},turn_ms=300"
IDLE_TIMEOUT: Final = "3s"
PROMPTS_AFTER_WAKE: Final = 2
STEP_TIMEOUT: Final = 60.0

STACK_SETTINGS: Final = {
    "DRAIN_RECONCILE_INTERVAL_SECS": "0.5",
    "DRAIN_HEARTBEAT_INTERVAL_SECS": "1",
    "DRAIN_HEARTBEAT_POLL_SECS": "0.2",
}
"""The dev stack's cadence for the demo: a heartbeat a second, so an idle pause follows
the ``idleTimeout`` within about a second (``dev up``'s own default is 5 s)."""

LOCK_FILE: Final = Path(tempfile.gettempdir()) / f"caliban-drain-demo-{os.getuid()}.lock"


class DemoFailure(Exception):
    """A step of the story did not happen as it should; the message says which."""


class DemoBusy(DemoFailure):
    """Another demo is running, or the port asked for is taken."""


@dataclass
class Step:
    name: str
    what: str
    started_secs: float
    took_secs: float
    commands: list[str]
    """What a user types to do this step by hand."""


@dataclass
class AgentTurns:
    agent: str
    turns: dict[str, int] = field(default_factory=dict)
    """Completed turns at each point of the story (``COLUMNS``)."""
    lost: int = 0


COLUMNS: Final = ("running", "paused", "woken", "deleted", "restored")
"""The points of the story at which each agent's turns are read: on disk once every agent
is idle in the first task, in the pause checkpoint, on disk after the prompts that
follow the wake, in the deletion checkpoint, on disk in the restored task once it has
answered one prompt."""


@dataclass
class Summary:
    ok: bool
    duration_secs: float
    state_dir: str | None
    """Where the state was kept (``--state-dir``); None: a temporary dir, removed."""
    steps: list[Step]
    checkpoints: dict[str, str]
    """``paused`` and ``deleted``: the refs of the two checkpoints."""
    agents: list[AgentTurns]
    lost_turns: int
    audit_findings: list[str]
    error: str | None = None

    def as_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


# ----------------------------------------------------------------------------- helpers


def task_manifest(name: str, agents: int, resume_from: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"task": {"provider": "scripted", "model": MODEL}}
    if resume_from is None:
        spec["task"]["agents"] = agents
        spec["lifecycle"] = {"idleTimeout": IDLE_TIMEOUT}
    else:
        spec["resumeFrom"] = {"checkpointRef": resume_from}
    return {
        "apiVersion": crd.API_VERSION,
        "kind": crd.KIND,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }


@contextlib.contextmanager
def only_demo(state: Path) -> Iterator[None]:
    """Hold the per-user demo lock for the whole run; ``DemoBusy`` if another holds it."""
    LOCK_FILE.touch(exist_ok=True)
    with LOCK_FILE.open("r+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock.read().strip() or "unknown"
            raise DemoBusy(
                f"another drainctl demo is running ({holder}); wait for it to finish or "
                "stop it (Ctrl-C), then run this again"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}, state in {state}")
        lock.flush()
        try:
            yield
        finally:
            lock.truncate(0)


def check_port(port: int) -> None:
    if port == 0:
        return
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise DemoBusy(
                f"port {port} on 127.0.0.1 is in use; pick another with --port (0: any free one)"
            ) from None


def stack_environment() -> dict[str, str]:
    """This environment without the settings that would point the stack elsewhere: the
    demo runs on the embedded defaults, whatever the shell has exported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAIN_") and k != "KUBECONFIG"}
    return {**env, **STACK_SETTINGS}


def _resumed_from(directory: Path) -> list[int]:
    """The ``from_turn`` of every resume in the agent's transcript, in order."""
    found = []
    with contextlib.suppress(OSError):
        for line in layout.transcript_file(directory).read_text().splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                turn = transcript.resumed_from(event) if isinstance(event, dict) else None
                if turn is not None:
                    found.append(turn)
    return found


# ------------------------------------------------------------------------------- story


class Story:
    def __init__(
        self, root: Path, agents: int, port: int, echo: Echo | None, *stack_args: str
    ) -> None:
        self.root = root
        self.stack_args = stack_args  # more ``drainctl dev up`` options (tests: --rbac)
        self.agent_count = agents
        self.port = port
        self.echo = echo
        self.started = time.monotonic()
        self.steps: list[Step] = []
        self.turns: dict[str, AgentTurns] = {}
        self.checkpoints: dict[str, str] = {}
        self.audit_findings: list[str] = []
        self.stack: DevStackProcess | None = None
        self._api: Any = None

    # -- output

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def say(self, line: str) -> None:
        if self.echo is not None:
            self.echo(line)

    def progress(self, line: str) -> None:
        self.say(f"[{self.elapsed():5.1f}s] {line}")

    def hint(self, *commands: str) -> None:
        for command in commands:
            self.say(f"         $ {command}")

    def kubectl(self, *args: str) -> str:
        assert self.stack is not None
        return f"kubectl --kubeconfig {self.stack.kubeconfig} {' '.join(args)}"

    @contextlib.contextmanager
    def step(self, name: str, what: str, *commands: str) -> Iterator[Step]:
        self.progress(f"{len(self.steps) + 1}. {name}: {what}")
        self.hint(*commands)
        step = Step(name, what, round(self.elapsed(), 2), 0.0, list(commands))
        began = time.monotonic()
        yield step
        step.took_secs = round(time.monotonic() - began, 2)
        self.steps.append(step)

    # -- the stack and its API

    def start_stack(self) -> None:
        stack = DevStackProcess(
            self.root,
            "--fresh",
            "--port",
            str(self.port),
            *self.stack_args,
            env=stack_environment(),
        )
        self.stack = stack
        self.progress("starting the dev stack (drainctl dev up) ...")
        try:
            stack.start()
        except (WaitTimeout, ProcessExited):
            error = next(
                (line for line in reversed(stack.log_text().splitlines()) if "Error" in line),
                f"drainctl dev up did not come up; see {stack.log}",
            )
            raise DemoFailure(error.strip()) from None
        from kubernetes import config

        self._api = config.new_client_from_config(config_file=str(stack.kubeconfig))
        self.progress(
            f"stack up: embedded Kubernetes API, embedded redis:// broker, SQLite ledger, "
            f"operator, worker, auditor, stand-in Sandbox controller (logs in "
            f"{stack.state / 'logs'})"
        )
        self.hint(f"export KUBECONFIG={stack.kubeconfig}")

    def custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self._api)

    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self._api)

    def task(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            found: dict[str, Any] = self.custom().get_namespaced_custom_object(
                crd.GROUP, crd.VERSION, NAMESPACE, crd.PLURAL, name
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return found

    def status(self, name: str) -> dict[str, Any]:
        return dict((self.task(name) or {}).get("status") or {})

    def wait(self, what: str, condition: Callable[[], Any], timeout: float = STEP_TIMEOUT) -> Any:
        assert self.stack is not None
        stack = self.stack

        def checked() -> Any:
            stack.check_alive("drainctl dev up")
            return condition()

        try:
            return wait_until(checked, timeout, what, interval=0.05)
        except WaitTimeout as exc:
            raise DemoFailure(f"{exc}; logs in {stack.state / 'logs'}") from None
        except ProcessExited as exc:
            raise DemoFailure(str(exc).splitlines()[0]) from None

    def resource_version(self) -> str:
        """The CalibanTasks' list version now: a watch from it sees every later change."""
        listed = self.custom().list_namespaced_custom_object(
            crd.GROUP, crd.VERSION, NAMESPACE, crd.PLURAL
        )
        return str(listed["metadata"]["resourceVersion"])

    def states_until_gone(
        self, name: str, since: str, timeout: float = STEP_TIMEOUT
    ) -> list[dict[str, Any]]:
        """Every state of CalibanTask ``name`` the API sent after ``since``, the last
        being its deletion. A watch, not a poll: a state that lasts a few milliseconds
        (a fast deletion's ``Draining`` with its checkpoint) is seen however fast the
        operator goes."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        assert self.stack is not None
        states: list[dict[str, Any]] = []
        stream = watch.Watch()
        try:
            for event in stream.stream(
                self.custom().list_namespaced_custom_object,
                crd.GROUP,
                crd.VERSION,
                NAMESPACE,
                crd.PLURAL,
                resource_version=since,
                timeout_seconds=int(timeout),
            ):
                obj = event["object"]
                if (obj.get("metadata") or {}).get("name") != name:
                    continue
                states.append(obj)
                if event["type"] == "DELETED":
                    return states
        except (ApiException, HTTPError) as exc:
            self.stack.check_alive("drainctl dev up")
            raise DemoFailure(f"watching {name} failed: {exc}".splitlines()[0]) from None
        finally:
            stream.stop()
        self.stack.check_alive("drainctl dev up")
        raise DemoFailure(
            f"{name} was not gone within {timeout:g}s; logs in {self.stack.state / 'logs'}"
        )

    def wait_phase(self, name: str, phase: str, *, agents: int | None = None) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            status = self.status(name)
            if status.get("phase") == "Failed":
                raise DemoFailure(f"{name} failed: {status.get('message')}")
            if status.get("phase") != phase:
                return None
            if agents is not None and status.get("agents") != agents:
                return None
            return status

        live = f" with {agents} agents live" if agents is not None else ""
        found: dict[str, Any] = self.wait(f"{name} to be {phase}{live}", reached)
        return found

    # -- what is on disk and in the ledger

    @property
    def ledger_url(self) -> str:
        assert self.stack is not None
        return f"sqlite:///{self.stack.state / LEDGER_FILE}"

    @property
    def sandboxes(self) -> Path:
        """The stand-in Sandbox controller's dir: volumes, snapshot copies, pods' dirs."""
        assert self.stack is not None
        return self.stack.state / SANDBOXES_DIR

    def volume(self, pvc: str) -> Path:
        return csi.volume_dir(self.sandboxes, NAMESPACE, pvc)

    def sessions(self, pvc: str) -> dict[str, int]:
        """Completed turns of every agent whose session is on ``pvc``'s volume."""
        agents = layout.agents_dir(self.volume(pvc))
        found = {}
        for directory in sorted(agents.iterdir()) if agents.is_dir() else []:
            with contextlib.suppress(OSError, SessionError):
                found[directory.name] = load_session(directory).turns
        return found

    def record(self, column: str, turns: dict[str, int]) -> None:
        for agent, count in turns.items():
            self.turns.setdefault(agent, AgentTurns(agent)).turns[column] = count

    def ledger_turns(self, ref: str) -> dict[str, int]:
        from orchestrator.ledger import Ledger

        assert self.stack is not None
        ledger = Ledger.from_url(self.ledger_url)
        try:
            checkpoint = ledger.get_checkpoint(ref)
        finally:
            ledger.dispose()
        if checkpoint is None:
            raise DemoFailure(f"status.checkpointRef {ref} is not in the ledger")
        return {agent.agent_id: agent.turns for agent in checkpoint.agents}

    def sandbox_api_version(self, name: str) -> str:
        """The Sandbox API version task ``name`` talks to its Sandbox in (pinned in its
        status when it was first seen)."""
        pinned = self.status(name).get("sandboxApiVersion")
        if not isinstance(pinned, str):
            raise DemoFailure(f"{name} has no status.sandboxApiVersion")
        return pinned

    def sandbox(self, name: str) -> dict[str, Any]:
        """Task ``name``'s Sandbox, read in the version the task uses."""
        version = self.sandbox_api_version(name).partition("/")[2]
        found: dict[str, Any] = self.custom().get_namespaced_custom_object(
            crd.SANDBOX_GROUP, version, NAMESPACE, crd.SANDBOX_PLURAL, crd.sandbox_name(name)
        )
        return found

    def sandbox_suspended(self, name: str) -> bool:
        return crd.sandbox_suspended(self.sandbox_api_version(name), self.sandbox(name))

    def suspension_field(self, name: str) -> str:
        """How task ``name``'s Sandbox says it is suspended: ``operatingMode Suspended``
        (v1beta1) or ``replicas 0`` (v1alpha1)."""
        from orchestrator.operator.lifecycle import sandbox_suspension_patch

        patch = sandbox_suspension_patch(self.sandbox_api_version(name), True)["spec"]
        return ", ".join(f"{key} {value}" for key, value in patch.items())

    def check_resumed(self, pvc: str, at: dict[str, int], what: str) -> None:
        """Every agent of ``at`` resumed on ``pvc`` at its ``turns + 1``."""
        for agent, turns in at.items():
            resumed = _resumed_from(layout.agent_dir(self.volume(pvc), agent))
            if not resumed or resumed[-1] != turns + 1:
                raise DemoFailure(
                    f"{what}: {agent} resumed from turn {resumed[-1] if resumed else 'none'}, "
                    f"not {turns + 1}"
                )

    # -- the steps

    def run(self) -> None:
        self.start_stack()
        manifest_file = self.root / f"{TASK}.yaml"
        manifest_file.write_text(yaml.safe_dump(task_manifest(TASK, self.agent_count)))
        with self.step(
            "create",
            f"a CalibanTask with {self.agent_count} scripted agents, idleTimeout {IDLE_TIMEOUT}",
            self.kubectl("apply", "-f", str(manifest_file)),
            self.kubectl("get", "ctask", TASK, "-w"),
        ):
            self.custom().create_namespaced_custom_object(
                crd.GROUP, crd.VERSION, NAMESPACE, crd.PLURAL, task_manifest(TASK, self.agent_count)
            )
            status = self.wait_phase(TASK, "Running", agents=self.agent_count)
            pvc = str(status["pvcName"])
            self.progress(f"   {TASK} Running: {status['agents']} agents live, workspace PVC {pvc}")

        with self.step(
            "idle pause",
            f"the agents finish their {SCRIPTED_TURNS} turns and go idle; after "
            f"{IDLE_TIMEOUT} the task is drained, checkpointed and its Sandbox suspended",
            self.kubectl(
                "get", "ctask", TASK, "-o", "jsonpath='{.status.phase} {.status.checkpointRef}'"
            ),
        ):
            idle = self.wait(
                f"{self.agent_count} agents to finish {SCRIPTED_TURNS} turns",
                lambda: (
                    (t := self.sessions(pvc))
                    and len(t) == self.agent_count
                    and all(v >= SCRIPTED_TURNS for v in t.values())
                    and t
                ),
            )
            self.record("running", idle)
            status = self.wait_phase(TASK, "Suspended")
            if status.get("pausedBy") != "idle":
                raise DemoFailure(f"{TASK} was paused by {status.get('pausedBy')}, not idle")
            paused = str(status["checkpointRef"])
            self.checkpoints["paused"] = paused
            self.record("paused", self.ledger_turns(paused))
            if not self.sandbox_suspended(TASK):
                raise DemoFailure(f"{TASK} is Suspended but its Sandbox still runs")
            self.progress(
                f"   {TASK} Suspended (pausedBy idle): checkpoint {paused}, Sandbox "
                f"{self.suspension_field(TASK)}, no daemon"
            )

        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        with self.step(
            "wake",
            "the wake annotation resumes every agent at turns + 1; a prompt to each "
            "continues its conversation",
            self.kubectl(
                "annotate", "ctask", TASK, f"{crd.WAKE_ANNOTATION}={stamp}", "--overwrite"
            ),
        ) as wake:
            self.custom().patch_namespaced_custom_object(
                crd.GROUP,
                crd.VERSION,
                NAMESPACE,
                crd.PLURAL,
                TASK,
                {"metadata": {"annotations": {crd.WAKE_ANNOTATION: stamp}}},
            )
            self.wait_phase(TASK, "Running", agents=self.agent_count)
            at_pause = self.ledger_turns(paused)
            self.wait(
                "every agent to resume at turns + 1",
                lambda: all(
                    _resumed_from(layout.agent_dir(self.volume(pvc), a))[-1:] == [t + 1]
                    for a, t in at_pause.items()
                ),
            )
            by_hand = f"drainctl agents --socket {self.prompt_all(TASK)} prompt AGENT_ID 'go on'"
            self.hint(by_hand)
            wake.commands.append(by_hand)
            self.wait(
                f"every agent to answer {PROMPTS_AFTER_WAKE} prompts",
                lambda: (
                    (t := self.sessions(pvc))
                    and all(t.get(a, 0) >= n + PROMPTS_AFTER_WAKE for a, n in at_pause.items())
                ),
            )
            self.progress(
                f"   {TASK} Running again: every agent resumed at turns + 1 and "
                f"answered {PROMPTS_AFTER_WAKE} more prompts"
            )

        with self.step(
            "delete",
            "kubectl delete: Draining → checkpoint → gone, the workspace PVC kept",
            self.kubectl("delete", "ctask", TASK),
            self.kubectl("get", "pvc", pvc),
        ):
            self.record("woken", self.sessions(pvc))  # every prompt answered: nothing moves
            since = self.resource_version()
            self.custom().delete_namespaced_custom_object(
                crd.GROUP, crd.VERSION, NAMESPACE, crd.PLURAL, TASK
            )
            seen: dict[str, str] = {}
            for state in self.states_until_gone(TASK, since):
                status = state.get("status") or {}
                if status.get("phase"):
                    seen.setdefault(f"phase {status['phase']}", status["phase"])
                ref = status.get("checkpointRef")
                if status.get("phase") == "Draining" and ref and ref != paused:
                    seen["ref"] = str(ref)  # until recorded, it is still the pause's
            if self.task(TASK) is not None:
                raise DemoFailure(f"the watch saw {TASK} deleted, but a GET still finds it")
            if "phase Draining" not in seen:
                raise DemoFailure(f"{TASK} was never seen Draining (seen: {sorted(seen)})")
            deleted = self.deletion_checkpoint()
            if seen.get("ref") not in (None, deleted):
                raise DemoFailure(f"status.checkpointRef was {seen['ref']}, the ledger's {deleted}")
            if "ref" not in seen:
                raise DemoFailure(f"status.checkpointRef was never seen on {TASK} while Draining")
            self.checkpoints["deleted"] = deleted
            recorded = self.ledger_turns(deleted)
            self.record("deleted", recorded)
            self.core().read_namespaced_persistent_volume_claim(pvc, NAMESPACE)
            self.progress(
                f"   {TASK} gone: checkpoint {deleted} seen in status.checkpointRef "
                f"while Draining; PVC {pvc} kept"
            )

        restored_file = self.root / f"{RESTORED}.yaml"
        restored_file.write_text(yaml.safe_dump(task_manifest(RESTORED, 0, deleted)))
        with self.step(
            "restore",
            f"a new task with spec.resumeFrom.checkpointRef {deleted} continues every agent "
            "at turns + 1",
            self.kubectl("apply", "-f", str(restored_file)),
        ):
            self.custom().create_namespaced_custom_object(
                crd.GROUP, crd.VERSION, NAMESPACE, crd.PLURAL, task_manifest(RESTORED, 0, deleted)
            )
            status = self.wait_phase(RESTORED, "Running", agents=len(recorded))
            new_pvc = str(status["pvcName"])
            self.wait(
                "every restored agent to resume at turns + 1",
                lambda: all(
                    _resumed_from(layout.agent_dir(self.volume(new_pvc), a))[-1:] == [t + 1]
                    for a, t in recorded.items()
                ),
            )
            self.prompt_all(RESTORED, prompts=1)
            self.record(
                "restored",
                self.wait(
                    "every restored agent to answer a prompt",
                    lambda: (
                        (t := self.sessions(new_pvc))
                        and all(t.get(a, 0) > n for a, n in recorded.items())
                        and t
                    ),
                ),
            )
            self.progress(
                f"   {RESTORED} Running on PVC {new_pvc}: every agent resumed at "
                "turns + 1 from the deleted task's checkpoint, then answered a "
                "prompt"
            )

        with self.step(
            "audit",
            "drainctl audit checks every claim of the status and the ledger",
            self.audit_command(),
        ):
            self.audit_findings = self.audit()
            self.progress(
                "   audit clean"
                if not self.audit_findings
                else f"   audit found {len(self.audit_findings)}: {self.audit_findings}"
            )

    def stop(self) -> None:
        """Stop the stack (``dev up`` drains its daemons on the way out), deaf to a second
        Ctrl-C so that nothing is left half stopped; what outlives the grace is killed."""
        if self.stack is None:
            return
        handlers = {
            sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            self.stack.stop(60)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def prompt_all(self, name: str, prompts: int = PROMPTS_AFTER_WAKE) -> Path:
        """Send each live agent of task ``name`` ``prompts`` prompts through its daemon
        (the pod's control socket); the socket's path."""
        from orchestrator.devcluster.sandbox_controller import empty_dir
        from worker_agent.client import SupervisorClient

        assert self.stack is not None
        sandbox = self.sandbox(name)
        run = empty_dir(self.sandboxes, sandbox["metadata"]["uid"], crd.RUN_VOLUME)
        path = run / crd.DAEMON_SOCKET_FILE
        with SupervisorClient(socket_path=path, timeout=30) as daemon:
            live = [a for a in daemon.agents() if a.status.value in ("running", "idle")]
            for agent in live:
                for n in range(prompts):
                    daemon.prompt(agent.id, f"demo prompt {n + 1} to {name}")
        return path

    def deletion_checkpoint(self) -> str:
        from orchestrator.ledger import Ledger

        assert self.stack is not None
        ledger = Ledger.from_url(self.ledger_url)
        try:
            newest = ledger.list_checkpoints(NAMESPACE, TASK, limit=1)
        finally:
            ledger.dispose()
        if not newest or newest[0].ref == self.checkpoints.get("paused"):
            raise DemoFailure(f"no deletion checkpoint of {TASK} in the ledger")
        return newest[0].ref

    def audit_command(self) -> str:
        assert self.stack is not None
        return (
            f"DRAIN_DATABASE_URL={self.ledger_url} drainctl audit --kubeconfig "
            f"{self.stack.kubeconfig} --volumes {self.sandboxes}"
        )

    def audit(self) -> list[str]:
        assert self.stack is not None
        env = {
            **stack_environment(),
            "DRAIN_DATABASE_URL": self.ledger_url,
            "KUBECONFIG": str(self.stack.kubeconfig),
        }
        result = subprocess.run(
            [*DRAINCTL, "audit", "--json", "--volumes", str(self.sandboxes)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=env,
        )
        if result.returncode not in (0, 1):
            raise DemoFailure(f"drainctl audit failed: {result.stderr.strip()}")
        report = json.loads(result.stdout)
        return [f"{f['kind']} {f['subject']}: {f['message']}" for f in report["findings"]]

    # -- the verdict

    def lost_turns(self) -> int:
        """Completed turns a later point of the story no longer has, over every agent: a
        count that went down from one point to the next, or an agent missing from a point
        the others reached (all its turns)."""
        reached = [c for c in COLUMNS if any(c in a.turns for a in self.turns.values())]
        total = 0
        for agent in self.turns.values():
            agent.lost, last = 0, None
            for column in reached:
                now = agent.turns.get(column)
                if now is None:
                    agent.lost += last or 0
                    break
                if last is not None:
                    agent.lost += max(0, last - now)
                last = now
            total += agent.lost
        return total

    def table(self) -> str:
        rows = [f"{'AGENT':<20} " + " ".join(f"{c.upper():>8}" for c in COLUMNS) + f" {'LOST':>5}"]
        for agent in sorted(self.turns.values(), key=lambda a: a.agent):
            cells = " ".join(f"{agent.turns.get(c, '-')!s:>8}" for c in COLUMNS)
            rows.append(f"{agent.agent:<20} {cells} {agent.lost:>5}")
        rows.append("")
        rows.append(f"{'STEP':<12} {'AT':>7} {'TOOK':>7}")
        for step in self.steps:
            rows.append(f"{step.name:<12} {step.started_secs:>6.1f}s {step.took_secs:>6.1f}s")
        rows.append("")
        for name, ref in self.checkpoints.items():
            rows.append(f"checkpoint {name:<8} {ref}")
        return "\n".join(rows)


def _raise_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def run_story(
    *, agent_count: int, state_dir: Path | None, port: int, as_json: bool, echo: Echo
) -> int:
    """The whole story; 0 when every step happened and no completed turn was lost, 1
    otherwise, 130 when interrupted. Nothing it started outlives it."""
    root = state_dir or Path(tempfile.mkdtemp(prefix="caliban-demo-", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    story = Story(root, agent_count, port, None if as_json else echo)
    # Both installed, not inherited: a shell starts a background job with SIGINT ignored,
    # and Python then never turns Ctrl-C into KeyboardInterrupt.
    previous = {
        sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    error: str | None = None
    code = 0
    try:
        with only_demo(root):
            check_port(port)
            story.say(f"caliban-drain demo: the whole story on the embedded defaults (in {root})")
            try:
                story.run()
            finally:
                story.stop()
    except DemoBusy:
        raise
    except DemoFailure as exc:
        error, code = str(exc), 1
    except KeyboardInterrupt:
        echo("interrupted: the stack is stopped, nothing is left running")
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if state_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    lost = story.lost_turns()
    ok = error is None and lost == 0 and not story.audit_findings
    if as_json:
        summary = Summary(
            ok=ok,
            duration_secs=round(story.elapsed(), 2),
            state_dir=None if state_dir is None else str(root),
            steps=story.steps,
            checkpoints=story.checkpoints,
            agents=sorted(story.turns.values(), key=lambda a: a.agent),
            lost_turns=lost,
            audit_findings=story.audit_findings,
            error=error,
        )
        echo(summary.as_json())
    else:
        echo("")
        echo(story.table())
        echo("")
        if error is not None:
            echo(f"demo failed: {error}")
        elif lost:
            echo(f"demo failed: {lost} completed turns were lost")
        elif story.audit_findings:
            echo("demo failed: the audit found what the status or the ledger got wrong")
        else:
            echo(f"no completed turn was lost; the whole story took {story.elapsed():.1f}s.")
    return code or (0 if ok else 1)
