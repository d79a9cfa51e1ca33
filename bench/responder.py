"""``python -m bench.responder --store DIR --queues FILE``: the daemon side of many tasks
as one light Celery worker, for the ``controlplane`` benchmark.

A task's pod runs a daemon, its agents and a consumer; what the control plane sees of
it is only the consumer's answers. This worker consumes every task queue listed in
FILE (``caliband.<namespace>.<name>``, one per line) and answers what a consumer
answers, built from a session prepared on disk for each task (``DIR/<name>`` is that
task's store, ``agents/<id>/session.json`` in caliban's session format):

- ``caliban.daemon.drain``: a ``DrainResult`` with one ``ResumeRef`` per prepared
  session (its turns and sha256 read from the file, as a daemon's drain reads them);
- ``caliban.daemon.resume``: a ``ResumeResult``, every agent asked for resumed.

Each answer names the task uid the request named, as a pod serving that task does. The
chain's next step (the orchestrator's record) is sent by Celery as it is from a real
consumer. No agent runs and no pod exists: what a deletion costs beyond this is the
control plane's.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
from pathlib import Path

from celery import Celery, Task
from celery.signals import worker_ready

from worker_agent import layout
from worker_agent.celery_worker import run_worker
from worker_agent.contract import (
    DAEMON_DRAIN,
    DAEMON_RESUME,
    AgentResumeOutcome,
    BrokerSettings,
    DrainRequest,
    DrainResult,
    JsonObject,
    ResumeRequest,
    ResumeResult,
    celery_config,
    parse_daemon_queue,
)
from worker_agent.proto import ResumeRef
from worker_agent.session import Session as SessionDoc
from worker_agent.session import decode_session, save_session

log = logging.getLogger(__name__)

AGENT = "a0"
"""The one agent of each prepared store."""
PREPARED_TURNS = 3
READY = "responder ready."
"""Printed once the worker consumes (it logs warnings only)."""

app = Celery("caliban-drain-responder")
STORES: list[Path] = []
"""The directory holding one store per task name (set by ``main``)."""


def prepare(stores: Path, names: list[str]) -> None:
    """A store with one saved session (``PREPARED_TURNS`` turns) for each of ``names``."""
    for name in names:
        directory = layout.agent_dir(stores / name, AGENT)
        directory.mkdir(parents=True, exist_ok=True)
        messages = []
        for turn in range(1, PREPARED_TURNS + 1):
            messages.append({"role": "user", "content": f"turn {turn}"})
            messages.append({"role": "assistant", "content": f"reply {turn}"})
        save_session(directory, SessionDoc(AGENT, PREPARED_TURNS, messages, {}, ""))


def _task_of(task: Task) -> tuple[str, str]:  # type: ignore[type-arg]
    queue = str((task.request.delivery_info or {}).get("routing_key", ""))
    return parse_daemon_queue(queue)


def _ref(store: Path, directory: Path) -> ResumeRef:
    raw = layout.session_file(directory).read_bytes()
    session = decode_session(raw, source=str(directory))
    return ResumeRef(
        id=directory.name,
        session_dir=str(directory.relative_to(store)),
        turns=session.turns,
        session_sha256=hashlib.sha256(raw).hexdigest(),
        clean=True,
        exit=None,
    )


@app.task(name=DAEMON_DRAIN, bind=True)
def drain(self: Task, /, **payload: object) -> JsonObject:  # type: ignore[type-arg]
    request = DrainRequest.model_validate(payload)
    namespace, name = _task_of(self)
    store = STORES[0] / name
    agents = sorted(layout.agents_dir(store).iterdir())
    result = DrainResult(
        op_id=request.op_id,
        namespace=namespace,
        name=name,
        refs=[_ref(store, d) for d in agents],
        error=None,
        task_uid=request.task_uid,
    )
    return result.model_dump(mode="json")


@app.task(name=DAEMON_RESUME, bind=True)
def resume(self: Task, /, **payload: object) -> JsonObject:  # type: ignore[type-arg]
    request = ResumeRequest.model_validate(payload)
    _, name = _task_of(self)
    asked = [a.id for a in request.agents] or [
        d.name for d in sorted(layout.agents_dir(STORES[0] / name).iterdir())
    ]
    return ResumeResult(
        op_id=request.op_id,
        results=[AgentResumeOutcome(id=agent, ok=True) for agent in asked],
        error=None,
        task_uid=request.task_uid,
    ).model_dump(mode="json")


def _ready(**_: object) -> None:
    print(READY, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.responder")
    parser.add_argument("--store", type=Path, required=True, help="one store per task name")
    parser.add_argument("--queues", type=Path, required=True, help="task queues, one a line")
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args(argv)
    queues = args.queues.read_text().split()
    STORES.append(args.store)
    app.conf.update(celery_config(BrokerSettings()))
    worker_ready.connect(_ready, weak=False)
    return run_worker(
        app,
        queues=queues,
        hostname="responder@%h",
        pool="threads",
        concurrency=args.concurrency,
        loglevel="WARNING",
        without_gossip=True,
        without_mingle=True,
    )


if __name__ == "__main__":
    sys.exit(main())
