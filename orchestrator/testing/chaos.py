"""Lifecycle chaos: random sequences of user actions and faults on ``drainctl dev up``,
judged after every step by the turns on disk, the ledger and the audit.

``python -m orchestrator.testing.chaos --seed S --sequences N --steps M [--json]``

The seed decides everything: the stack (with or without snapshots, the embedded broker
or Redis, a SQLite or a PostgreSQL ledger), and for each sequence, on a fresh stack, up
to ``MAX_TASKS`` tasks (in ``default`` and in namespaces of the sequence's own) driven
through ``M`` steps, each a user action or a fault. The user actions: create (running,
created suspended, idle: agents that finish and an ``idleTimeout`` that pauses the task,
caliban-operator's shape bound to a Workspace, or a restore of a deleted task's latest
checkpoint), delete, delete the namespace,
suspend and resume through the spec, ``drainctl pause`` and ``wake``, the wake
annotation, a scale, an edit of the env or the image (each rolls the pod), ``drainctl
ledger prune``. The faults: SIGKILL or SIGSTOP/SIGCONT of the operator, the
orchestrator worker, a task's daemon or one of its agents; SIGKILL of its consumer; an
eviction (the pod stopped gracefully) and a lost node (the pod's whole tree SIGKILLed
at once); the whole stack SIGKILLed and started again on its state (its embedded API and
broker included); its Redis broker or PostgreSQL ledger (servers of the run's own) down
for 2-20 s and started again. Every timing setting is the default.

After each step, once the stack has had ``settle_secs`` (derived from the settings) to
converge, the oracle:

- every completed turn on disk exactly once: each agent's transcript announces each turn
  once (a turn announced again is a duplicate), and a resume never goes back past a turn
  it had announced (the turns between are lost); each session's prompts are turns 1..n;
- exactly one checkpoint per drain (``Ledger.drain_record_problems``);
- every task in the phase its spec asks for (``Running`` with its agents live, or
  ``Suspended``: asked to, or idle), every deleted task gone: what is not, within the
  bound, is wedged;
- ``drainctl audit`` clean; no process left serving a deleted task's workspace.

A failing sequence is shrunk: steps are dropped, one at a time, while the shorter
sequence (replayed on a fresh stack) still fails the same way, within ``SHRINK_REPLAYS``
replays. ``--json`` prints the run's figures (``seed``, ``sequences``,
``steps``, ``faults``, ``lost_turns``, ``duplicate_checkpoints``, ``wedged``,
``audit_findings``) and each failure's shortest sequence. Exit 0: nothing found; 1: a
finding; 2: bad arguments (one line); 130: interrupted. Whatever it started is stopped
on every way out, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from orchestrator.operator.crd import GROUP, VERSION, WAKE_ANNOTATION
from orchestrator.operator.lifecycle.availability import HEARTBEATS_MISSED_BEFORE_SILENT
from orchestrator.settings import Settings
from orchestrator.testing import (
    DevStackProcess,
    ServerUnavailable,
    fresh_ledger,
)
from orchestrator.testing.servers import ModelServer, PostgresServer, RedisServer
from worker_agent import layout, transcript
from worker_agent.children import descendants
from worker_agent.reaper import KILL_TREE
from worker_agent.session import SessionError, load_session, message_text
from worker_agent.testing import DRAINCTL

if TYPE_CHECKING:
    from orchestrator.ledger import Ledger

NAMESPACE = "default"
MAX_TASKS = 5
MODEL = "turns=100000,turn_ms=300"
"""Each agent works a turn every 0.3 s for as long as the sequence lasts."""
SHRINK_REPLAYS = 6
STOP_SECS = (2, 20)
"""How long a SIGSTOPped process stays stopped (seconds, drawn in this range)."""

EDIT_IMAGES = 3
EDIT_IMAGE = "caliban-drain-chaos"
"""An ``edit-image`` sets ``caliban-drain-chaos:<1..EDIT_IMAGES>``, images the stack's
operator is told it may run (``DRAIN_ALLOWED_IMAGES``, a deployment's list, not a
timing): the dev stack's pods are local processes, so each rolls the pod and runs the
same code."""
IDLE_MODEL = "turns=3,turn_ms=300"
"""An idle task's agents: three turns, then waiting for a prompt that never comes."""
IDLE_TIMEOUT = "20s"
"""An idle task's ``lifecycle.idleTimeout``: it pauses itself that long after its agents
went idle, and after every wake."""

USER_ACTIONS = ("create", "create-suspended", "create-idle", "create-workspace", "restore",
                "delete",
                "delete-namespace", "suspend", "resume", "pause", "wake", "wake-annotation",
                "scale", "edit-env", "edit-image", "prune")  # fmt: skip
FAULTS = ("kill-operator", "stop-operator", "kill-worker", "stop-worker", "kill-daemon",
          "stop-daemon", "kill-consumer", "kill-agent", "stop-agent", "evict",
          "node-loss", "restart-stack", "restart-broker", "restart-database")  # fmt: skip
CREATES = ("create", "create-suspended", "create-idle", "create-workspace", "restore")
SHAPES = {"create": "plain", "create-suspended": "plain", "create-idle": "idle",
          "create-workspace": "workspace"}  # fmt: skip
"""What a create makes (a restore makes what its source was)."""


def quiet_secs(settings: Settings) -> float:
    """How long the end of a sequence waits before its last judgement: long enough for a
    daemon killed by its last step to be called silent and brought back (a step is
    judged as soon as the stack looks right, which a fault may not have shown yet)."""
    return (HEARTBEATS_MISSED_BEFORE_SILENT + 1) * settings.heartbeat_interval_secs


def settle_secs(settings: Settings) -> float:
    """How long the stack may take to converge after a step: a daemon is called silent
    after ``HEARTBEATS_MISSED_BEFORE_SILENT`` intervals, a drain takes up to its grace,
    a stopped process up to ``STOP_SECS``, and the operator's passes and a pod's start
    are allowed a minute more."""
    silent = HEARTBEATS_MISSED_BEFORE_SILENT * settings.heartbeat_interval_secs
    return silent + settings.default_grace_secs + STOP_SECS[1] + 60.0


# ----------------------------------------------------------------------- choices


@dataclass(frozen=True)
class StackChoice:
    snapshots: bool
    broker: str
    """``embedded`` or ``redis``."""
    ledger: str
    """``sqlite`` or ``postgresql``."""

    @classmethod
    def of_seed(cls, seed: int) -> StackChoice:
        rng = random.Random(f"stack-{seed}")
        return cls(
            snapshots=rng.random() < 0.5,
            broker=rng.choice(("embedded", "redis")),
            ledger=rng.choice(("sqlite", "postgresql")),
        )

    @property
    def servers(self) -> tuple[str, ...]:
        """The servers of the stack's own that a fault may restart: a Redis broker, a
        PostgreSQL ledger (the embedded broker and SQLite go only with the stack)."""
        return (("broker",) if self.broker == "redis" else ()) + (
            ("database",) if self.ledger == "postgresql" else ()
        )

    def line(self) -> str:
        snaps = "snapshots" if self.snapshots else "no snapshots"
        return f"{snaps}, {self.broker} broker, {self.ledger} ledger"


@dataclass(frozen=True)
class Move:
    kind: str
    task: str | None = None
    value: int | None = None
    """A create's or a scale's agent count; a stop's seconds; a prune's ``--keep``; an
    edit's new value."""
    namespace: str = NAMESPACE
    """The task's namespace (a create's, or the one a namespace deletion deletes)."""
    source: str | None = None
    """A restore's deleted task, whose latest checkpoint it restores."""

    def line(self) -> str:
        task = (
            self.task
            if self.namespace == NAMESPACE or not self.task
            else (f"{self.namespace}/{self.task}")
        )
        if self.kind == "delete-namespace":
            task = self.namespace
        parts = [self.kind, task or "", "" if self.value is None else str(self.value),
                 f"from {self.source}" if self.source else ""]  # fmt: skip
        return " ".join(p for p in parts if p)

    @property
    def fault(self) -> bool:
        return self.kind in FAULTS


@dataclass
class TaskModel:
    agents: int
    suspended: bool
    """``spec.lifecycle.suspend``."""
    started: bool
    """Whether it ever ran (a task created suspended has no checkpoint to wake from)."""
    namespace: str = NAMESPACE
    shape: str = "plain"
    """``plain``: scripted agents that work on; ``idle``: scripted agents that go idle,
    and an ``idleTimeout`` that pauses the task (it settles Suspended); ``workspace``:
    caliban-operator's shape, bound to a Workspace (its git source cloned by the pod's init
    container, its provider a model server of the run's own)."""

    @property
    def idle(self) -> bool:
        return self.shape == "idle"

    @property
    def wants_suspended(self) -> bool:
        return self.suspended or self.idle


@dataclass
class Model:
    """What the user asked of each task, so far: the oracle's expectations."""

    tasks: dict[str, TaskModel] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    created: int = 0
    namespaces: list[str] = field(default_factory=list)
    """Namespaces of the sequence's own (never ``default``) not deleted."""
    namespaces_made: int = 0
    restorable: dict[str, TaskModel] = field(default_factory=dict)
    """Deleted tasks that ran, by name, whose latest checkpoint no restore took yet and
    no prune released."""
    servers: tuple[str, ...] = ()
    """``StackChoice.servers``: what ``restart-broker`` and ``restart-database`` restart."""

    def choose(self, rng: random.Random) -> Move:
        """A move valid now, user actions three times as likely as faults."""
        names = sorted(self.tasks)
        running = [n for n in names if not self.tasks[n].wants_suspended]
        idle = [n for n in names if self.tasks[n].idle and not self.tasks[n].suspended]
        suspended = [n for n in names if self.tasks[n].suspended]
        options: list[Move] = []
        if len(names) < MAX_TASKS:
            name = f"t{self.created}"
            namespace = rng.choice([NAMESPACE, NAMESPACE, *self.namespaces,
                                    f"ns{self.namespaces_made}"])  # fmt: skip
            options += [Move(kind, name, rng.randint(1, 3), namespace)
                        for kind in SHAPES]  # fmt: skip
            for source in sorted(self.restorable):
                was = self.restorable[source]
                options.append(Move("restore", name, was.agents, was.namespace, source))
        for name in names:
            options.append(Move("delete", name, namespace=self.tasks[name].namespace))
        for namespace in self.namespaces:
            options.append(Move("delete-namespace", namespace=namespace))
        for name in running:
            options += [Move("suspend", name), Move("pause", name),
                        Move("scale", name, rng.randint(1, 3)),
                        Move("edit-env", name, rng.randint(1, 999)),
                        Move("edit-image", name, rng.randint(1, EDIT_IMAGES))]  # fmt: skip
        for name in idle:
            options += [Move("suspend", name), Move("pause", name), Move("wake-annotation", name)]
        for name in suspended:
            options += [Move("resume", name), Move("wake", name)]
        if self.deleted:  # a prune's work: the checkpoints of deleted tasks
            options.append(Move("prune", value=rng.choice((0, 1))))
        faults = [Move("kill-operator"), Move("kill-worker"), Move("restart-stack"),
                  Move("stop-operator", None, rng.randint(*STOP_SECS)),
                  Move("stop-worker", None, rng.randint(*STOP_SECS))]  # fmt: skip
        faults += [Move(f"restart-{server}", None, rng.randint(*STOP_SECS))
                   for server in self.servers]  # fmt: skip
        for name in running:
            faults += [Move("kill-daemon", name), Move("kill-consumer", name),
                       Move("kill-agent", name), Move("evict", name), Move("node-loss", name),
                       Move("stop-daemon", name, rng.randint(*STOP_SECS)),
                       Move("stop-agent", name, rng.randint(*STOP_SECS))]  # fmt: skip
        if options and (not faults or rng.random() < 0.75):
            return rng.choice(options)
        return rng.choice(faults)

    def apply(self, move: Move) -> None:
        task = self.tasks.get(move.task or "")
        if move.kind in CREATES:
            assert move.task is not None and move.value is not None
            suspended = move.kind == "create-suspended"
            shape = SHAPES.get(move.kind, "plain")
            if move.kind == "restore":
                shape = self.restorable.pop(str(move.source)).shape
            self.tasks[move.task] = TaskModel(move.value, suspended, not suspended,
                                              move.namespace, shape)  # fmt: skip
            self.created += 1
            if move.namespace != NAMESPACE and move.namespace not in self.namespaces:
                self.namespaces.append(move.namespace)
                self.namespaces_made += 1
        elif move.kind == "delete" and task is not None:
            del self.tasks[str(move.task)]
            self.deleted.append(str(move.task))
            if task.started:
                self.restorable[str(move.task)] = task
        elif move.kind == "delete-namespace":
            for name in [n for n, t in self.tasks.items() if t.namespace == move.namespace]:
                del self.tasks[name]
                self.deleted.append(name)
            self.restorable = {n: t for n, t in self.restorable.items()
                               if t.namespace != move.namespace}  # fmt: skip
            self.namespaces.remove(move.namespace)
        elif move.kind in ("suspend", "pause") and task is not None:
            task.suspended = True
        elif move.kind in ("resume", "wake") and task is not None:
            task.suspended, task.started = False, True
        elif move.kind == "scale" and task is not None and move.value is not None:
            task.agents = move.value
        elif move.kind == "prune" and move.value == 0:
            self.restorable.clear()  # --keep 0: every checkpoint no live task names goes

    def namespace_of(self, name: str) -> str:
        task = self.tasks.get(name)
        return NAMESPACE if task is None else task.namespace


def plan(seed: int, sequence: int, steps: int) -> list[Move]:
    """The moves of sequence ``sequence`` of ``seed``: the same for the same three."""
    rng = random.Random(f"moves-{seed}-{sequence}")
    model = Model(servers=StackChoice.of_seed(seed).servers)
    moves = []
    for _ in range(steps):
        move = model.choose(rng)
        model.apply(move)
        moves.append(move)
    return moves


def replayable(moves: Sequence[Move]) -> list[Move]:
    """``moves`` without those that make no sense once others were dropped (a move on a
    task not created, or already deleted; a restore of a task not deleted, or already
    restored; a namespace deletion of a namespace not there)."""
    model = Model()
    kept = []
    for move in moves:
        exists = move.task in model.tasks
        if move.kind in CREATES:
            if exists or move.task in model.deleted:
                continue
            if move.kind == "restore" and move.source not in model.restorable:
                continue
        elif move.kind == "delete-namespace":
            if move.namespace not in model.namespaces:
                continue
        elif move.task is not None and not exists:
            continue
        model.apply(move)
        kept.append(move)
    return kept


# ------------------------------------------------------------------------ oracle


@dataclass
class TurnCount:
    lost: int = 0
    duplicated: int = 0
    problems: list[str] = field(default_factory=list)


def transcript_turns(path: Path) -> TurnCount:
    """Turn accounting of one agent's transcript: a turn announced complete twice is a
    duplicate (a ``recovered`` announcement re-announces one saved, never counted); a
    resume that continues below the turns already announced lost those between."""
    count = TurnCount()
    done = 0
    for event in transcript.events(path):
        start = transcript.resumed_from(event)
        if start is not None:
            if start - 1 < done:
                count.lost += done - (start - 1)
                count.problems.append(f"{path}: resumed at turn {start} after turn {done}")
                done = start - 1
            continue
        turn = transcript.completed_turn(event)
        if turn is None:
            continue
        if transcript.ours(event).get("recovered"):
            done = max(done, turn)
            continue
        if turn <= done:
            count.duplicated += 1
            count.problems.append(f"{path}: turn {turn} announced again after turn {done}")
        done = max(done, turn)
    return count


def session_turns(session_dir: Path) -> list[str]:
    """What is wrong with a session's own record of its turns: its scripted prompts are
    turns 1..n, each once."""
    if not layout.session_file(session_dir).exists():
        return []
    try:
        session = load_session(session_dir)
    except SessionError as exc:
        return [f"{session_dir}: unreadable session ({exc})"]
    if session.extra.get("provider") != "scripted":
        return []  # a model server's conversation: its prompts are the user's own
    prompts = [message_text(m) for m in session.messages if m.get("role") == "user"]
    numbers = [p.removeprefix("scripted prompt ") for p in prompts]
    if numbers != [str(k) for k in range(1, len(numbers) + 1)]:
        return [f"{session_dir}: its prompts are turns {', '.join(numbers[:12])}…"]
    return []


def turns_on_disk(volumes: Path) -> TurnCount:
    """Every agent of every workspace under ``volumes`` (the dev stack's PVCs, kept as
    long as their PVC is)."""
    total = TurnCount()
    for agents in sorted(volumes.glob(f"*/*/{layout.AGENTS_DIR}")):
        for agent in sorted(p for p in agents.iterdir() if p.is_dir()):
            count = transcript_turns(layout.transcript_file(agent))
            total.lost += count.lost
            total.duplicated += count.duplicated
            total.problems += count.problems + session_turns(agent)
    return total


# ------------------------------------------------------------ a workspace's world

WORKSPACE = "chaos-ws"


def model_reply(body: dict[str, Any]) -> str:
    """The run's model server's answer: the turn it answers (the user messages so far)."""
    asked = sum(m.get("role") == "user" for m in body.get("messages") or [])
    return f"the local model answers turn {asked}"


def source_repository(path: Path) -> None:
    """A bare git repository at ``path`` with one commit: the Workspace's source."""
    work = path.with_name(path.name + ".work")
    env = {**os.environ, "GIT_AUTHOR_NAME": "chaos", "GIT_AUTHOR_EMAIL": "chaos@localhost",
           "GIT_COMMITTER_NAME": "chaos", "GIT_COMMITTER_EMAIL": "chaos@localhost"}  # fmt: skip
    work.mkdir()
    (work / "README").write_text("the chaos workspace's source\n")
    for argv in (["git", "init", "-q", "-b", "main", str(work)],
                 ["git", "-C", str(work), "add", "README"],
                 ["git", "-C", str(work), "commit", "-q", "-m", "source"],
                 ["git", "clone", "-q", "--bare", str(work), str(path)]):  # fmt: skip
        subprocess.run(argv, env=env, check=True, capture_output=True, timeout=60)


# ------------------------------------------------------------------------- stack


class ChaosStack:
    """One ``drainctl dev up`` for one sequence, and what the moves do to it."""

    def __init__(self, root: Path, choice: StackChoice) -> None:
        self.root = root
        self.choice = choice
        self.redis: RedisServer | None = None
        self.postgres: PostgresServer | None = None
        env: dict[str, str] = {}
        if choice.broker == "redis":
            (root / "redis").mkdir()
            self.redis = RedisServer(directory=root / "redis", persistent=True)
            env |= {"DRAIN_BROKER_URL": self.redis.url(), "DRAIN_RESULT_BACKEND": self.redis.url()}
        env["DRAIN_DATABASE_URL"] = f"sqlite:///{root / 'ledger.db'}"
        if choice.ledger == "postgresql":
            self.postgres = PostgresServer()
            env["DRAIN_DATABASE_URL"] = self.postgres.url
        images = (f"{EDIT_IMAGE}:{k}" for k in range(1, EDIT_IMAGES + 1))
        env["DRAIN_ALLOWED_IMAGES"] = ",".join(images)
        extra = () if choice.snapshots else ("--no-snapshots",)
        self.env = env
        self.stack = DevStackProcess(root, *extra, env=env)
        self.pvcs: dict[str, tuple[str, str]] = {}
        """Each deleted task's (namespace, PVC), for ``left_running``."""
        self.models: ModelServer | None = None

    def __enter__(self) -> ChaosStack:
        try:
            if self.redis is not None:
                self.redis.start()
            if self.postgres is not None:
                self.postgres.start()
                fresh_ledger(self.postgres.url)
            self.stack.start(120)
        except BaseException:  # not ready in time, or Ctrl-C while it starts
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.stack.proc is not None:
                self.stack.stop(120)
        finally:
            if self.models is not None:
                self.models.shutdown()
                self.models.server_close()
            if self.redis is not None:
                self.redis.stop(graceful=False)
            if self.postgres is not None:
                self.postgres.close()

    @property
    def volumes(self) -> Path:
        return self.stack.state / "sandboxes" / "volumes"

    def kubectl(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["kubectl", "--kubeconfig", str(self.stack.kubeconfig), *args],
            capture_output=True, text=True, input=stdin, timeout=120, check=False,
        )  # fmt: skip

    def drainctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **self.env, "KUBECONFIG": str(self.stack.kubeconfig)}
        return subprocess.run([*DRAINCTL, *args], capture_output=True, text=True, env=env,
                              timeout=300, check=False)  # fmt: skip

    def tasks(self) -> dict[str, dict[str, Any]]:
        """Every task, by name (names are unique across the sequence's namespaces)."""
        listed = self.kubectl("get", "ctask", "--all-namespaces", "-o", "json")
        if listed.returncode != 0:
            return {}
        items = json.loads(listed.stdout).get("items") or []
        return {str(t["metadata"]["name"]): t for t in items}

    def patch(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        self.kubectl("patch", "ctask", name, "-n", namespace, "--type=merge", "-p",
                     json.dumps(body))  # fmt: skip

    def processes(self, *words: str) -> list[int]:
        """The stack's processes whose command line has each of ``words`` as an argument."""
        return [p for p in descendants(self.stack.pid) if set(words) <= set(_argv(p))]

    def serving(self, namespace: str, pvc: str) -> list[int]:
        """Processes whose ``--store`` is ``pvc``'s volume (a pod's reaper and daemon)."""
        volume = str(self.volumes / namespace / pvc)
        found = []
        for pid in descendants(self.stack.pid):
            argv = _argv(pid)
            if "--store" in argv and argv[argv.index("--store") + 1] == volume:
                found.append(pid)
        return found

    def pvc_of(self, name: str) -> str | None:
        pvc = ((self.tasks().get(name) or {}).get("status") or {}).get("pvcName")
        return str(pvc) if pvc else None

    def pod_of(self, name: str, namespace: str) -> tuple[list[int], list[int]]:
        """A task's pod as processes: its reapers (the pod's init) and its daemons."""
        pvc = self.pvc_of(name)
        serving = self.serving(namespace, pvc) if pvc else []
        reapers = [p for p in serving if "worker_agent.reaper" in _argv(p)]
        return reapers, [p for p in serving if p not in reapers]

    # -- the moves

    def do(self, move: Move, rng: random.Random, model: Model) -> None:
        name = move.task or ""
        namespace = move.namespace if move.kind in CREATES else model.namespace_of(name)
        if move.kind in CREATES:
            was = model.restorable.get(str(move.source))
            self.create(move, namespace, SHAPES.get(move.kind) or (was.shape if was else "plain"))
        elif move.kind == "delete":
            if pvc := self.pvc_of(name):
                self.pvcs[name] = (namespace, pvc)
            self.kubectl("delete", "ctask", name, "-n", namespace, "--wait=false")
        elif move.kind == "delete-namespace":
            for task in self.tasks().values():
                meta, status = task["metadata"], task.get("status") or {}
                if meta.get("namespace") == move.namespace and status.get("pvcName"):
                    self.pvcs[meta["name"]] = (move.namespace, str(status["pvcName"]))
            self.kubectl("delete", "namespace", move.namespace, "--wait=false")
        elif move.kind in ("suspend", "resume"):
            self.patch(name, namespace,
                       {"spec": {"lifecycle": {"suspend": move.kind == "suspend"}}})  # fmt: skip
        elif move.kind in ("pause", "wake"):
            self.drainctl(move.kind, f"{namespace}/{name}")
        elif move.kind == "wake-annotation":
            stamp = f"chaos-{time.time():.6f}"
            self.kubectl("annotate", "ctask", name, "-n", namespace, "--overwrite",
                         f"{WAKE_ANNOTATION}={stamp}")  # fmt: skip
        elif move.kind == "scale":
            self.patch(name, namespace, {"spec": {"task": {"agents": move.value}}})
        elif move.kind == "edit-env":
            env = [{"name": "CHAOS_EDIT", "value": str(move.value)}]
            self.patch(name, namespace, {"spec": {"task": {"env": env}}})
        elif move.kind == "edit-image":
            self.patch(name, namespace, {"spec": {"task": {"image": f"{EDIT_IMAGE}:{move.value}"}}})
        elif move.kind == "prune":
            self.drainctl("ledger", "prune", "--keep", str(move.value))
        elif move.kind == "restart-stack":
            self.restart(settle_secs(Settings()))
        elif move.kind in ("restart-broker", "restart-database"):
            self.restart_server(move)
        elif move.kind in ("kill-operator", "kill-worker", "stop-operator", "stop-worker"):
            which = "operator" if "operator" in move.kind else "worker"
            pids = [p for p in self.processes("orchestrator.cli", which)
                    if p != self.stack.pid]  # fmt: skip
            self.hurt(move, pids)
        else:
            self.hurt_pod(move, name, namespace, rng)

    def create(self, move: Move, namespace: str, shape: str) -> None:
        if namespace != NAMESPACE:
            self.kubectl("create", "namespace", namespace)  # already there: refused, fine
        spec: dict[str, Any] = {
            "task": {"agents": move.value, "provider": "scripted",
                     "model": IDLE_MODEL if shape == "idle" else MODEL},
        }  # fmt: skip
        if move.kind == "create-suspended":
            spec["lifecycle"] = {"suspend": True}
        if move.kind == "restore":
            ref = self.restorable_checkpoint(namespace, str(move.source))
            if ref is not None:
                spec["resumeFrom"] = {"checkpointRef": ref}
        if shape == "idle":
            spec["lifecycle"] = {"idleTimeout": IDLE_TIMEOUT}
        if shape == "workspace":
            self.kubectl("apply", "-f", "-", stdin=json.dumps(self.workspace(namespace)))
            spec["workspaceRef"] = {"name": WORKSPACE}
            spec["providerRef"] = "local"
            spec["task"] = {"agents": move.value, "prompt": "begin"}
        manifest = {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "CalibanTask",
            "metadata": {"name": move.task, "namespace": namespace}, "spec": spec,
        }  # fmt: skip
        self.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))

    def workspace(self, namespace: str) -> dict[str, Any]:
        """The Workspace of ``namespace``'s workspace-shaped tasks, as caliban-operator's
        sample writes one: a git source (a repository of the run's own) and a provider
        (an OpenAI-compatible model server of the run's own, on 127.0.0.1)."""
        if self.models is None:
            self.models = ModelServer(model_reply).start()
            source_repository(self.root / "source.git")
        return {
            "apiVersion": f"{GROUP}/v1alpha1", "kind": "Workspace",
            "metadata": {"name": WORKSPACE, "namespace": namespace},
            "spec": {
                "displayName": "chaos",
                "sources": [{"name": "app", "repo": f"file://{self.root / 'source.git'}",
                             "path": "/work/app"}],
                "providers": [{"name": "local", "kind": "openai-compatible",
                               "baseUrl": self.models.base_url, "model": "chaos"}],
            },
        }  # fmt: skip

    @contextlib.contextmanager
    def ledger(self) -> Iterator[Ledger]:
        """The stack's ledger, for the oracle's reads; disposed afterwards."""
        from orchestrator.ledger import Ledger

        ledger = Ledger.from_url(self.env["DRAIN_DATABASE_URL"])
        try:
            yield ledger
        finally:
            ledger.dispose()

    def restorable_checkpoint(self, namespace: str, source: str) -> str | None:
        """The latest checkpoint of the deleted task ``source``, or None when it has none
        to restore (a deletion that saved nothing): the restore is then a plain create."""
        with self.ledger() as ledger:
            checkpoint = ledger.latest_checkpoint(namespace, source)
        if checkpoint is None or not checkpoint.available:
            return None
        return checkpoint.ref

    def restart(self, bound: float) -> None:
        """The whole stack SIGKILLed (its embedded API and broker, the operator, the
        worker, every pod: a control plane and its node lost at once), then started again
        on the same state dir, as ``drainctl dev up`` is after a crash: the API's objects,
        the workspace volumes and the ledger are what they were.

        The embedded broker keeps its messages in memory: an operation in flight at the
        crash waits for its deadline (minutes past the settle bound; docs/reliability.md),
        so on that broker the crash comes once no operation is in flight (within
        ``bound``). A Redis broker keeps its messages, and the crash comes at once."""
        if self.choice.broker == "embedded":
            deadline = time.monotonic() + bound
            while self.operations_in_flight() and time.monotonic() < deadline:
                time.sleep(1.0)
        self.stack.note_descendants()
        self.stack.signal(signal.SIGKILL)
        self.stack.reap(0)
        self.stack.start(120)

    def restart_server(self, move: Move) -> None:
        """The Redis broker stopped (SIGTERM: it writes its append-only file) or the
        PostgreSQL ledger stopped (a fast shutdown), down for the move's seconds, then
        started again on its data: what a restart of either looks like to the stack."""
        server = self.redis if move.kind == "restart-broker" else self.postgres
        if server is None:
            return
        server.stop()
        time.sleep(move.value or STOP_SECS[0])  # interrupted here: the run stops it all
        server.start()

    def hurt(self, move: Move, pids: Sequence[int]) -> None:
        """SIGKILL ``pids``, or SIGSTOP them for the move's seconds and then SIGCONT."""
        if move.kind.startswith("kill"):
            signal_all(pids, signal.SIGKILL)
            return
        signal_all(pids, signal.SIGSTOP)
        try:
            time.sleep(move.value or STOP_SECS[0])
        finally:
            signal_all(pids, signal.SIGCONT)

    def hurt_pod(self, move: Move, name: str, namespace: str, rng: random.Random) -> None:
        """A fault of one task's pod: its daemon, its consumer or one of its agents killed
        or stopped; an eviction (the pod stopped gracefully: SIGTERM, the daemon drains);
        a lost node (the pod's whole tree SIGKILLed at once). The Sandbox's controller
        starts the pod again, as a Sandbox's pod is recreated."""
        reapers, daemons = self.pod_of(name, namespace)
        if move.kind == "evict":
            signal_all(reapers, signal.SIGTERM)
        elif move.kind == "node-loss":
            signal_all(reapers, KILL_TREE)
        elif move.kind in ("kill-daemon", "stop-daemon"):
            self.hurt(move, daemons)
        else:
            children = [c for p in daemons for c in descendants(p)]
            word = (
                "worker_agent.consumer" if move.kind == "kill-consumer" else "worker_agent.worker"
            )
            found = sorted({c for c in children if word in " ".join(_argv(c))})
            if found:
                self.hurt(move, [rng.choice(found)])

    # -- the oracle

    def unsettled(self, model: Model) -> list[str]:
        """What is not yet as the model asks: a task not in its phase (or not with its
        agents live), a deleted task still there."""
        tasks = self.tasks()
        wrong = []
        for name, want in sorted(model.tasks.items()):
            status = (tasks.get(name) or {}).get("status") or {}
            phase, agents = status.get("phase"), status.get("agents")
            if want.wants_suspended:
                if phase != "Suspended":
                    wrong.append(f"{name}: {phase}, want Suspended")
            elif phase != "Running" or agents != want.agents:
                wrong.append(f"{name}: {phase} with {agents} agents live, want Running with "
                             f"{want.agents}")  # fmt: skip
        for name in model.deleted:
            if name in tasks:
                wrong.append(f"{name}: deleted, still there ({_phase(tasks[name])})")
        return wrong

    def left_running(self, model: Model) -> list[str]:
        """Processes still serving the workspace of a deleted task that is gone, unless
        a live task works on it now (a restore without snapshots claims the PVC)."""
        tasks = self.tasks()
        claimed = {(t["metadata"].get("namespace"), (t.get("status") or {}).get("pvcName"))
                   for t in tasks.values()}  # fmt: skip
        gone = [n for n in model.deleted if n not in tasks and self.pvcs.get(n) not in claimed]
        return [f"{name}: pid {pid} still serves its PVC {self.pvcs[name][1]}"
                for name in gone if name in self.pvcs
                for pid in self.serving(*self.pvcs[name])]  # fmt: skip

    def audit(self) -> list[str]:
        done = self.drainctl("audit", "--json", "--volumes", str(self.stack.state / "sandboxes"))
        try:
            report = json.loads(done.stdout)
        except ValueError:
            return [f"drainctl audit exited {done.returncode}: {done.stderr.strip()[-300:]}"]
        return [f"{f['kind']} {f['subject']}: {f['message']}" for f in report.get("findings", [])]

    def operations_in_flight(self) -> list[str]:
        with self.ledger() as ledger:
            return [o.id for o in ledger.list_operations(limit=1000) if not o.terminal]

    def duplicate_checkpoints(self) -> list[str]:
        with self.ledger() as ledger:
            return [str(p) for p in ledger.drain_record_problems()]


def _argv(pid: int) -> list[str]:
    import psutil

    try:
        return list(psutil.Process(pid).cmdline())
    except psutil.Error:
        return []


def _phase(task: dict[str, Any]) -> str:
    return str((task.get("status") or {}).get("phase"))


def signal_all(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


# -------------------------------------------------------------------------- runs


@dataclass
class Failure:
    sequence: int
    kind: str
    """``lost_turns``, ``duplicate_turns``, ``duplicate_checkpoints``, ``wedged``,
    ``audit_findings`` or ``left_running``."""
    details: list[str]
    moves: list[str]
    """The shortest sequence found that still fails this way."""


@dataclass
class Report:
    seed: int
    stack: str
    sequences: int = 0
    steps: int = 0
    faults: int = 0
    lost_turns: int = 0
    duplicate_turns: int = 0
    duplicate_checkpoints: int = 0
    wedged: int = 0
    audit_findings: int = 0
    failures: list[Failure] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.failures

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Outcome:
    steps: int
    faults: int
    kind: str | None = None
    details: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


def judge(
    chaos: ChaosStack, model: Model, bound: float
) -> tuple[str | None, list[str], dict[str, int]]:
    """The oracle after a step: the first kind of failure found, its details, and the
    counts of each kind."""
    deadline = time.monotonic() + bound
    while (wrong := chaos.unsettled(model)) and time.monotonic() < deadline:
        time.sleep(1.0)
    turns = turns_on_disk(chaos.volumes)
    doubled = chaos.duplicate_checkpoints()
    findings = chaos.audit() if not wrong else []
    left = chaos.left_running(model)
    counts = {"lost_turns": turns.lost, "duplicate_turns": turns.duplicated,
              "duplicate_checkpoints": len(doubled), "wedged": len(wrong),
              "audit_findings": len(findings)}  # fmt: skip
    for kind, details in (("lost_turns", turns.problems if turns.lost else []),
                          ("duplicate_turns", turns.problems if turns.duplicated else []),
                          ("duplicate_checkpoints", doubled), ("wedged", wrong),
                          ("left_running", left), ("audit_findings", findings),
                          ("turn_records", turns.problems)):  # fmt: skip
        if details:
            return kind, details, counts
    return None, [], counts


def run_sequence(
    moves: Sequence[Move],
    choice: StackChoice,
    rng: random.Random,
    bound: float,
    root: Path,
    say: Callable[[str], None],
) -> Outcome:
    """``moves`` on a fresh stack, judged after each; stops at the first failure."""
    model = Model()
    outcome = Outcome(0, 0)
    with ChaosStack(root, choice) as chaos:
        for move in moves:
            say(f"  step {outcome.steps + 1}: {move.line()}")
            chaos.do(move, rng, model)
            model.apply(move)
            outcome.steps += 1
            outcome.faults += move.fault
            kind, details, counts = judge(chaos, model, bound)
            for key, value in counts.items():
                outcome.counts[key] = max(outcome.counts.get(key, 0), value)
            if kind is not None:
                outcome.kind, outcome.details = kind, details
                break
        else:
            say(f"  quiet for {quiet_secs(Settings()):g}s, then judged once more")
            time.sleep(quiet_secs(Settings()))
            kind, details, _ = judge(chaos, model, bound)
            outcome.kind, outcome.details = kind, details
    return outcome


def shrink(
    moves: list[Move],
    outcome: Outcome,
    choice: StackChoice,
    seed: int,
    bound: float,
    scratch: Callable[[], Path],
    say: Callable[[str], None],
) -> list[Move]:
    """Drop steps one at a time (last first) while the rest still fails as ``outcome``
    did, at most ``SHRINK_REPLAYS`` replays; the shortest failing sequence found."""
    best = moves[: outcome.steps]
    replays = 0
    index = len(best) - 2  # the failing step itself stays
    while index >= 0 and replays < SHRINK_REPLAYS:
        candidate = replayable(best[:index] + best[index + 1 :])
        if candidate and candidate != best:
            replays += 1
            say(f"  shrinking: replay {replays} without step {index + 1} ({len(candidate)} steps)")
            again = run_sequence(candidate, choice, random.Random(seed), bound, scratch(),
                                 lambda _line: None)  # fmt: skip
            if again.kind == outcome.kind:
                best = candidate[: again.steps]
        index -= 1
    return best


def run(seed: int, sequences: int, steps: int, say: Callable[[str], None]) -> Report:
    choice = StackChoice.of_seed(seed)
    report = Report(seed, choice.line())
    bound = settle_secs(Settings())
    with scratch_dirs() as scratch:
        for sequence in range(sequences):
            moves = plan(seed, sequence, steps)
            say(f"sequence {sequence + 1}/{sequences} ({choice.line()}): {len(moves)} steps")
            rng = random.Random(f"faults-{seed}-{sequence}")
            outcome = run_sequence(moves, choice, rng, bound, scratch(), say)
            report.sequences += 1
            report.steps += outcome.steps
            report.faults += outcome.faults
            report.lost_turns += outcome.counts.get("lost_turns", 0)
            report.duplicate_turns += outcome.counts.get("duplicate_turns", 0)
            report.duplicate_checkpoints += outcome.counts.get("duplicate_checkpoints", 0)
            report.wedged += outcome.counts.get("wedged", 0)
            report.audit_findings += outcome.counts.get("audit_findings", 0)
            if outcome.kind is not None:
                say(f"  FAILED ({outcome.kind}): {'; '.join(outcome.details[:3])}")
                shortest = shrink(moves, outcome, choice, seed, bound, scratch, say)
                report.failures.append(Failure(sequence, outcome.kind, outcome.details[:20],
                                               [m.line() for m in shortest]))  # fmt: skip
    return report


@contextlib.contextmanager
def scratch_dirs() -> Iterator[Callable[[], Path]]:
    """Fresh directories (short paths: the stack's sockets live under them), removed at
    the end."""
    top = Path(tempfile.mkdtemp(prefix="cd-chaos-", dir="/tmp"))
    made = iter(range(1_000_000))
    try:
        yield lambda: Path(tempfile.mkdtemp(prefix=f"{next(made)}-", dir=top))
    finally:
        shutil.rmtree(top, ignore_errors=True)


# --------------------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"chaos: {message}\n")


def whole(minimum: int) -> Callable[[str], int]:
    """An argument type: a whole number of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _Parser(
        prog="python -m orchestrator.testing.chaos", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--seed", type=whole(0), required=True, help="decides the stack and every move"
    )
    parser.add_argument(
        "--sequences", type=whole(1), required=True, help="sequences, each on a fresh stack"
    )
    parser.add_argument("--steps", type=whole(1), required=True, help="steps in each sequence")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser.parse_args(argv)


def _interrupt(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("kubectl") is None:
        print("chaos: kubectl is not installed (the harness drives the stack with it)",
              file=sys.stderr)  # fmt: skip
        return 1
    say: Callable[[str], None] = (
        (lambda line: print(line, file=sys.stderr, flush=True))
        if args.json
        else (lambda line: print(line, flush=True))
    )
    # Ctrl-C and SIGTERM stop the run the same way: through every ``finally`` that
    # stops a stack.
    signal.signal(signal.SIGTERM, _interrupt)
    # Installed, not inherited: a run started where SIGINT is ignored (a background job
    # of a script) still stops on Ctrl-C, as it says it does.
    signal.signal(signal.SIGINT, _interrupt)
    try:
        report = run(args.seed, args.sequences, args.steps, say)
    except KeyboardInterrupt:
        print("chaos: interrupted; everything it started is stopped", file=sys.stderr)
        return 130
    except ServerUnavailable as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.as_json(), indent=1))
    else:
        print(f"seed {report.seed} ({report.stack}): {report.sequences} sequences, "
              f"{report.steps} steps, {report.faults} faults; lost turns {report.lost_turns}, "
              f"duplicate turns {report.duplicate_turns}, duplicate checkpoints "
              f"{report.duplicate_checkpoints}, wedged {report.wedged}, audit findings "
              f"{report.audit_findings}")  # fmt: skip
        for failure in report.failures:
            print(f"FAILED sequence {failure.sequence + 1} ({failure.kind}): "
                  f"{'; '.join(failure.details[:3])}")  # fmt: skip
            print("  shortest: " + " | ".join(failure.moves))
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
