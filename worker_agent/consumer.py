"""The daemon-side Celery consumer: one per Sandbox pod, beside the supervisor daemon.

It consumes the pod's own queue ``caliband.<namespace>.<name>`` and turns each task into
control requests on the local supervisor's Unix socket:

- ``caliban.daemon.drain(op_id, grace_secs)`` → ``drain`` → the resume refs;
- ``caliban.daemon.resume(op_id, agents)`` → ``resume`` of each agent not already live;

and it sends ``caliban.orchestrator.activity`` heartbeats (all-idle-since, counts) on
every change and at least every heartbeat interval. The pod holds no Kubernetes
credentials and no database URL: the broker is its only way out.

``drainctl daemon --queue … --broker …`` starts this module as a child process and
restarts it if it dies; it can also run alone as ``python -m worker_agent.consumer``.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import Task
from celery.signals import worker_ready, worker_shutting_down

from orchestrator.pipeline.app import (
    ACTIVITY,
    DAEMON_DRAIN,
    DAEMON_RESUME,
    ORCHESTRATOR_QUEUE,
    app,
)
from orchestrator.settings import get_settings
from worker_agent.client import ControlError, SupervisorClient
from worker_agent.journal import OperationJournal
from worker_agent.proto import AgentRecord, AgentStatus

log = logging.getLogger(__name__)

SUPERVISOR_RETRIES = 5


@dataclass(frozen=True)
class ConsumerConfig:
    """Where the local supervisor is and which task this pod serves (from the environment
    the daemon sets for its consumer child)."""

    socket: Path
    store: Path
    namespace: str
    name: str
    task_uid: str | None

    @classmethod
    def from_env(cls) -> ConsumerConfig:
        queue = os.environ["DRAIN_CONSUMER_QUEUE"]
        _, namespace, name = queue.split(".", 2)
        return cls(
            socket=Path(os.environ["DRAIN_DAEMON_SOCKET"]),
            store=Path(os.environ["DRAIN_DAEMON_STORE"]),
            namespace=namespace,
            name=name,
            task_uid=os.environ.get("DRAIN_TASK_UID") or None,
        )


def _client(config: ConsumerConfig, timeout: float) -> SupervisorClient:
    return SupervisorClient(socket_path=config.socket, timeout=timeout)


@app.task(name=DAEMON_DRAIN, bind=True, max_retries=SUPERVISOR_RETRIES)
def drain(self: Task[Any, Any], op_id: str, grace_secs: float) -> dict[str, Any]:
    """Drain every agent of this pod; answer the refs (the same ones on redelivery)."""
    config = ConsumerConfig.from_env()
    journal = OperationJournal(config.store)
    if (done := journal.get(op_id, "drain")) is not None:
        log.info("drain_redelivered op=%s answered_from=journal", op_id)
        return done
    try:
        with _client(config, timeout=grace_secs + 120) as client:
            refs = client.drain(grace_secs)
    except (ConnectionError, OSError, ControlError) as exc:
        if self.request.retries < SUPERVISOR_RETRIES:
            raise self.retry(countdown=1 + self.request.retries, exc=exc) from None
        return {"op_id": op_id, "refs": [], "error": f"supervisor unreachable: {exc}"}
    result = {
        "op_id": op_id,
        "namespace": config.namespace,
        "name": config.name,
        "refs": [ref.model_dump(mode="json") for ref in refs],
        "error": None,
    }
    journal.put(op_id, "drain", result)
    log.info(
        "drain_done op=%s task=%s/%s agents=%d unclean=%d",
        op_id, config.namespace, config.name, len(refs), sum(not r.clean for r in refs),
    )  # fmt: skip
    return result


@app.task(name=DAEMON_RESUME, bind=True, max_retries=SUPERVISOR_RETRIES)
def resume(self: Task[Any, Any], op_id: str, agents: list[dict[str, Any]]) -> dict[str, Any]:
    """Resume each agent of a checkpoint (all in the store when it names none); one that
    is already live counts as resumed."""
    config = ConsumerConfig.from_env()
    journal = OperationJournal(config.store)
    if (done := journal.get(op_id, "resume")) is not None:
        log.info("resume_redelivered op=%s answered_from=journal", op_id)
        return done
    results: list[dict[str, Any]] = []
    try:
        with _client(config, timeout=120) as client:
            records = client.agents()
            live = {r.id for r in records if r.status.live}
            if not agents:
                # A forced checkpoint names no agents: it is the PVC as it was, so every
                # agent found in the store is resumed.
                agents = [{"id": r.id, "session_dir": f"agents/{r.id}"} for r in records]
            for agent in agents:
                agent_id, session_dir = str(agent.get("id")), str(agent.get("session_dir"))
                if agent_id in live:
                    results.append({"id": agent_id, "ok": True, "note": "already running"})
                    continue
                try:
                    client.resume(session_dir)
                except ControlError as exc:
                    results.append({"id": agent_id, "ok": False, "error": exc.body.message})
                else:
                    results.append({"id": agent_id, "ok": True})
    except (ConnectionError, OSError) as exc:
        if self.request.retries < SUPERVISOR_RETRIES:
            raise self.retry(countdown=1 + self.request.retries, exc=exc) from None
        return {"op_id": op_id, "results": results, "error": f"supervisor unreachable: {exc}"}
    result = {"op_id": op_id, "results": results, "error": None}
    journal.put(op_id, "resume", result)
    log.info(
        "resume_done op=%s ok=%d failed=%d",
        op_id, sum(r["ok"] for r in results), sum(not r["ok"] for r in results),
    )  # fmt: skip
    return result


# ------------------------------------------------------------------------ heartbeats


def summarize(records: list[AgentRecord]) -> dict[str, Any]:
    """Counts, and since when every agent has been idle (None while any works).

    An agent that is not live (drained, done, …) does no work, so it counts as idle
    since it stopped; with no agents at all there is nothing to be idle.
    """
    live = [r for r in records if r.status.live]
    idle = [r for r in live if r.status is AgentStatus.IDLE]
    all_idle_since: float | None = None
    if records and len(idle) == len(live):
        moments = [r.idle_since or r.updated_at for r in idle]
        moments += [r.updated_at for r in records if not r.status.live]
        all_idle_since = max(moments)
    return {
        "agents_total": len(records),
        "agents_live": len(live),
        "agents_idle": len(idle),
        "all_idle_since": all_idle_since,
    }


class Heartbeat(threading.Thread):
    def __init__(self, config: ConsumerConfig) -> None:
        super().__init__(name="caliban-heartbeat", daemon=True)
        self.config = config
        settings = get_settings()
        self.interval = settings.heartbeat_interval_secs
        self.poll = settings.heartbeat_poll_secs
        self.stopping = threading.Event()

    def run(self) -> None:
        last: dict[str, Any] | None = None
        last_sent = 0.0
        while not self.stopping.wait(self.poll):
            try:
                with _client(self.config, timeout=10) as client:
                    summary = summarize(client.agents())
            except (ConnectionError, OSError) as exc:
                log.warning("heartbeat_supervisor_unreachable error=%s", exc)
                continue
            if summary == last and time.monotonic() - last_sent < self.interval:
                continue
            try:
                app.send_task(
                    ACTIVITY,
                    kwargs={
                        "namespace": self.config.namespace,
                        "name": self.config.name,
                        "task_uid": self.config.task_uid,
                        "seq": time.time_ns(),
                        "reported_at": time.time(),
                        **summary,
                    },
                    queue=ORCHESTRATOR_QUEUE,
                    expires=self.interval * 4,
                )
            except Exception as exc:  # the broker may be restarting; try next poll
                log.warning("heartbeat_send_failed error=%s", exc)
                continue
            last, last_sent = summary, time.monotonic()


_heartbeat: Heartbeat | None = None


@worker_ready.connect
def _start_heartbeat(**_: Any) -> None:
    global _heartbeat
    if os.environ.get("DRAIN_CONSUMER_QUEUE"):
        _heartbeat = Heartbeat(ConsumerConfig.from_env())
        _heartbeat.start()


@worker_shutting_down.connect
def _stop_heartbeat(**_: Any) -> None:
    if _heartbeat is not None:
        _heartbeat.stopping.set()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m worker_agent.consumer")
    parser.add_argument("--queue", required=True, help="caliband.<namespace>.<name>")
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--store", required=True, type=Path)
    parser.add_argument("--loglevel", default="INFO")
    args = parser.parse_args(argv)
    os.environ["DRAIN_CONSUMER_QUEUE"] = args.queue
    os.environ["DRAIN_DAEMON_SOCKET"] = str(args.socket)
    os.environ["DRAIN_DAEMON_STORE"] = str(args.store)
    app.worker_main(
        [
            "worker",
            "--queues", args.queue,
            "--pool", "solo",
            "--hostname", f"{args.queue}@%h",
            "--loglevel", args.loglevel,
            "--task-events",
            "--without-gossip",
            "--without-mingle",
        ]
    )  # fmt: skip


if __name__ == "__main__":
    main()
