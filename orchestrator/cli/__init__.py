"""``drainctl``: the one command line of caliban-drain.

Each subcommand imports what it needs when it runs, so ``drainctl daemon`` in a Sandbox
pod loads the daemon side only. Human output by default, ``--json`` for scripts;
errors say what was wrong and exit non-zero.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def require_extra(extra: str, module: str, what: str) -> None:
    """One line, not a traceback, when ``what`` needs an extra that is not installed."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise click.ClickException(
            f"{what} needs the {extra!r} extra, which is not installed: "
            f"pip install 'caliban-drain[{extra}]'"
        )


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s event=%(message)s",
    )


@click.group()
@click.version_option(package_name="caliban-drain")
def main() -> None:
    """caliban-drain: never lose an agent's work to a delete or an idle pause."""


# ---------------------------------------------------------------------------- daemon


@main.command()
@click.option("--store", type=click.Path(path_type=Path), help="Agent store (the PVC root).")
@click.option("--socket", "socket_path", type=click.Path(path_type=Path), help="Control socket.")
@click.option("--listen", help="HOST:PORT for the TLS network transport.")
@click.option("--token-file", type=click.Path(path_type=Path), help="Bearer token (network).")
@click.option("--tls-cert", type=click.Path(path_type=Path), help="TLS certificate (PEM).")
@click.option("--tls-key", type=click.Path(path_type=Path), help="TLS private key (PEM).")
@click.option("--worker-command", help="Worker command template (see README).")
@click.option("--drain-grace", type=float, help="Grace in seconds when the daemon is stopped.")
@click.option("--kill-grace", type=float, help="Seconds between SIGTERM and SIGKILL for kill.")
@click.option("--queue", help="caliband.<namespace>.<name>: also run this queue's Celery consumer.")
@click.option("--broker", "broker_url", help="The consumer's broker URL (else DRAIN_BROKER_URL).")
@click.option("--task-uid", help="The CalibanTask uid this pod serves (sent in heartbeats).")
@click.option("--initial-agents", type=int, help="Agents to spawn into an empty store.")
@click.option("--initial-provider", help="Provider of the initial agents.")
@click.option("--initial-model", help="Model of the initial agents.")
@click.option("--initial-prompt", help="Initial prompt of the initial agents.")
@click.option("--log-level", default="INFO", show_default=True)
def daemon(log_level: str, **options: Any) -> None:
    """Run the supervisor daemon in the foreground (SIGTERM drains, then exits)."""
    from pydantic import ValidationError

    from worker_agent.server import ConfigError, run_daemon
    from worker_agent.settings import DaemonSettings

    configure_logging(log_level)
    names = {
        "socket_path": "socket",
        "drain_grace": "drain_grace_secs",
        "kill_grace": "kill_grace_secs",
    }
    overrides = {names.get(k, k): v for k, v in options.items() if v is not None}
    try:
        settings = DaemonSettings(**overrides)
        asyncio.run(run_daemon(settings))
    except (ConfigError, ValidationError) as exc:
        raise click.ClickException(str(exc)) from None


# ---------------------------------------------------------------------------- agents


class _AgentsContext:
    def __init__(self, socket_path: Path, as_json: bool) -> None:
        self.socket_path = socket_path
        self.as_json = as_json

    def call(self, kind: str, **fields: Any) -> Any:
        from worker_agent.client import ControlError, SupervisorClient

        try:
            with SupervisorClient(socket_path=self.socket_path, timeout=None) as client:
                return client.call(kind, **fields)
        except (ConnectionError, ControlError) as exc:
            raise click.ClickException(str(exc)) from None

    def show(self, reply: Any, human: str) -> None:
        if self.as_json:
            click.echo(reply.model_dump_json(indent=2))
        else:
            click.echo(human)


@main.group()
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(path_type=Path),
    envvar="DRAIN_DAEMON_SOCKET",
    required=True,
    help="The daemon's control socket.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's reply as JSON.")
@click.pass_context
def agents(ctx: click.Context, socket_path: Path, as_json: bool) -> None:
    """Talk to a running daemon: ls, spawn, kill, rm, status, drain, resume."""
    ctx.obj = _AgentsContext(socket_path, as_json)


@agents.command("ls")
@click.pass_obj
def agents_ls(obj: _AgentsContext) -> None:
    """List agents."""
    reply = obj.call("list")
    rows = [f"{'ID':<20} {'STATUS':<9} {'TURNS':>5}  {'PROVIDER':<9} SESSION"]
    for record in reply.agents:
        rows.append(
            f"{record.id:<20} {record.status.value:<9} {record.turns:>5}  "
            f"{record.spec.provider:<9} {record.session_dir}"
        )
    obj.show(reply, "\n".join(rows) if reply.agents else "no agents")


@agents.command("spawn")
@click.option("--provider", default="scripted", show_default=True)
@click.option("--model", default=None, help='scripted: "turns=N,turn_ms=M".')
@click.option("--name", default=None)
@click.option("--prompt", "initial_prompt", default=None, help="Initial prompt.")
@click.option("--resume-session", default=None, help="Continue this session dir instead.")
@click.option("--count", default=1, show_default=True, type=click.IntRange(1, 1000))
@click.pass_obj
def agents_spawn(obj: _AgentsContext, /, count: int, **spec: Any) -> None:
    """Start agents (or continue one with --resume-session)."""
    clean = {k: v for k, v in spec.items() if v is not None}
    for _ in range(count):
        reply = obj.call("spawn", spec=clean)
        obj.show(reply, f"spawned {reply.id}  endpoint {reply.endpoint}")


@agents.command("kill")
@click.argument("agent_id")
@click.pass_obj
def agents_kill(obj: _AgentsContext, agent_id: str) -> None:
    """Stop an agent abruptly (SIGTERM, SIGKILL after the kill grace)."""
    reply = obj.call("kill", id=agent_id)
    obj.show(reply, f"killed {reply.id} (exit {reply.exit})")


@agents.command("rm")
@click.argument("agent_id")
@click.option("--force", is_flag=True, help="Kill a live agent first.")
@click.pass_obj
def agents_rm(obj: _AgentsContext, agent_id: str, force: bool) -> None:
    """Remove an agent and its session dir."""
    reply = obj.call("rm", id=agent_id, force=force)
    obj.show(reply, f"removed {reply.id}")


@agents.command("status")
@click.pass_obj
def agents_status(obj: _AgentsContext) -> None:
    """The daemon's pid, agent count, uptime and endpoint."""
    reply = obj.call("status")
    obj.show(
        reply,
        f"pid {reply.pid}  agents {reply.agents}  up {reply.uptime_secs:.1f}s  {reply.endpoint}",
    )


@agents.command("drain")
@click.option("--grace", "grace_secs", default=30.0, show_default=True, type=float)
@click.pass_obj
def agents_drain(obj: _AgentsContext, grace_secs: float) -> None:
    """Checkpoint, then stop every agent; print one resume reference per agent."""
    reply = obj.call("drain", grace_secs=grace_secs)
    rows = [f"{'ID':<20} {'TURNS':>5} {'CLEAN':<5} {'EXIT':>4}  SESSION  SHA256"]
    for ref in reply.agents:
        rows.append(
            f"{ref.id:<20} {ref.turns:>5} {ref.clean!s:<5} {ref.exit!s:>4}  {ref.session_dir}  "
            f"{(ref.session_sha256 or '-')[:16]}" + (f"  ({ref.error})" if ref.error else "")
        )
    obj.show(reply, "\n".join(rows))


@agents.command("resume")
@click.argument("session_dirs", nargs=-1, required=True)
@click.pass_obj
def agents_resume(obj: _AgentsContext, session_dirs: tuple[str, ...]) -> None:
    """Continue persisted conversations (session dirs absolute or relative to the store)."""
    for session_dir in session_dirs:
        reply = obj.call("resume", session_dir=session_dir)
        obj.show(reply, f"resumed {reply.id}  endpoint {reply.endpoint}")


# ---------------------------------------------------------------- pipeline (no k8s)


def _pipeline() -> tuple[Any, Any, Any]:
    from orchestrator.pipeline.app import app
    from orchestrator.pipeline.tasks import get_ledger
    from orchestrator.settings import get_settings

    return app, get_ledger(), get_settings()


def _task_ref(ref: str) -> tuple[str, str]:
    from orchestrator.pipeline.app import TaskNameError, parse_task_ref

    try:
        return parse_task_ref(ref)
    except TaskNameError as exc:
        raise click.BadParameter(str(exc), param_hint="NS/NAME") from None


def _finish(op: Any, wait: bool, timeout: float, as_json: bool, *, field: str) -> None:
    from orchestrator.pipeline.start import wait_for_operation

    if wait:
        _, ledger, _ = _pipeline()
        op = wait_for_operation(ledger, op.id, timeout)
    if as_json:
        click.echo(json.dumps(asdict(op), indent=2, default=str))
    elif not wait:
        click.echo(f"operation {op.id} {op.state}")
    elif op.state in ("recorded", "forced", "resumed"):
        click.echo(op.checkpoint_ref if field == "checkpoint" else f"{op.state} {op.id}")
    if wait and op.state not in ("recorded", "forced", "resumed"):
        why = op.error or f"still {op.state} after {timeout:.0f}s"
        raise click.ClickException(f"operation {op.id} {op.state}: {why}")


def _operation_options(wait_help: str) -> Callable[[F], F]:
    """The options every pipeline operation command shares."""

    def apply(command: F) -> F:
        for option in reversed(
            [
                click.option("--uid", "task_uid", default=None,
                             help="Task identity (default NS/NAME)."),
                click.option("--wait", is_flag=True, help=wait_help),
                click.option("--timeout", default=600.0, show_default=True, type=float),
                click.option("--json", "as_json", is_flag=True),
            ]
        ):  # fmt: skip
            command = option(command)
        return command

    return apply


@main.command("drain")
@click.argument("task")
@click.option("--grace", "grace_secs", type=float, default=None, help="Drain grace (seconds).")
@_operation_options("Wait until recorded; print the checkpoint ref.")
def drain_cmd(
    task: str,
    grace_secs: float | None,
    task_uid: str | None,
    wait: bool,
    timeout: float,
    as_json: bool,
) -> None:
    """Drain the daemon of NS/NAME through Celery and record a checkpoint."""
    from orchestrator.pipeline.start import start_drain

    namespace, name = _task_ref(task)
    app, ledger, settings = _pipeline()
    op = start_drain(
        app, ledger, settings, namespace=namespace, name=name, task_uid=task_uid,
        grace_secs=grace_secs,
    )  # fmt: skip
    _finish(op, wait, timeout, as_json, field="checkpoint")


@main.command("resume")
@click.argument("task")
@click.option("--checkpoint", "checkpoint_ref", required=True, help="Checkpoint ref to resume.")
@_operation_options("Wait until the daemon resumed the agents.")
def resume_cmd(
    task: str,
    checkpoint_ref: str,
    task_uid: str | None,
    wait: bool,
    timeout: float,
    as_json: bool,
) -> None:
    """Resume every agent of a checkpoint on the daemon of NS/NAME."""
    from orchestrator.pipeline.start import start_resume

    namespace, name = _task_ref(task)
    app, ledger, settings = _pipeline()
    op = start_resume(
        app, ledger, settings, namespace=namespace, name=name, checkpoint_ref=checkpoint_ref,
        task_uid=task_uid,
    )  # fmt: skip
    _finish(op, wait, timeout, as_json, field="state")


@main.command("worker")
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(1, 64))
@click.option("--loglevel", default="INFO", show_default=True)
def worker_cmd(concurrency: int, loglevel: str) -> None:
    """Run the orchestrator's Celery worker (queue ``orchestrator``)."""
    from orchestrator.pipeline.tasks import DeadlineSweeper

    app, ledger, settings = _pipeline()
    configure_logging(loglevel)
    DeadlineSweeper(ledger, settings.sweep_interval_secs).start()
    app.worker_main(
        [
            "worker", "--queues", "orchestrator", "--pool", "threads",
            "--concurrency", str(concurrency), "--hostname", "orchestrator@%h",
            "--loglevel", loglevel, "--task-events",
        ]
    )  # fmt: skip


@main.command("flower")
@click.option("--port", default=5555, show_default=True, type=int)
@click.option("--address", default="127.0.0.1", show_default=True)
def flower_cmd(port: int, address: str) -> None:
    """Flower on this broker: drain, record and resume tasks as they run.

    Flower's HTTP API needs credentials: set FLOWER_BASIC_AUTH=user:password (read by
    Flower itself, so it never shows in the process list), or, for a loopback-only dev
    stack, FLOWER_UNAUTHENTICATED_API=true.
    """
    import os

    require_extra("flower", "flower", "drainctl flower")
    if not os.environ.get("FLOWER_BASIC_AUTH") and not os.environ.get("FLOWER_UNAUTHENTICATED_API"):
        click.echo(
            "note: FLOWER_BASIC_AUTH is not set; Flower's API will answer 401 "
            "(set FLOWER_BASIC_AUTH=user:password)",
            err=True,
        )
    os.execv(  # noqa: S606 - replaces this process with Flower, argv fully ours
        sys.executable,
        [
            sys.executable, "-m", "celery", "--app", "orchestrator.pipeline.app", "flower",
            f"--port={port}", f"--address={address}",
        ],
    )  # fmt: skip


@main.group()
def db() -> None:
    """The checkpoint ledger's schema."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
def db_upgrade(revision: str) -> None:
    """Apply the Alembic migrations to DRAIN_DATABASE_URL."""
    from orchestrator.ledger.migrate import current, upgrade
    from orchestrator.settings import get_settings

    url = get_settings().database_url
    upgrade(url, revision)
    click.echo(f"ledger at revision {current(url)}")


@main.group()
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.pass_context
def ledger(ctx: click.Context, as_json: bool) -> None:
    """Read the checkpoint ledger."""
    ctx.obj = as_json


@ledger.command("ls")
@click.option("--task", "task", default=None, help="Only NS/NAME.")
@click.option("--limit", default=50, show_default=True, type=int)
@click.pass_obj
def ledger_ls(as_json: bool, task: str | None, limit: int) -> None:
    """Checkpoints, newest first."""
    from orchestrator.pipeline.tasks import get_ledger

    namespace, name = _task_ref(task) if task else (None, None)
    checkpoints = get_ledger().list_checkpoints(namespace=namespace, name=name, limit=limit)
    if as_json:
        click.echo(json.dumps([asdict(c) for c in checkpoints], indent=2, default=str))
        return
    click.echo(f"{'REF':<26} {'TASK':<32} {'REASON':<7} {'AGENTS':>6} {'VERIFIED':<8} CREATED")
    for c in checkpoints:
        click.echo(
            f"{c.ref:<26} {c.namespace + '/' + c.name:<32} {c.reason:<7} {len(c.agents):>6} "
            f"{c.verified!s:<8} {c.created_at:%Y-%m-%d %H:%M:%S}"
        )


@ledger.command("show")
@click.argument("ref")
@click.pass_obj
def ledger_show(as_json: bool, ref: str) -> None:
    """One checkpoint and its agents."""
    from orchestrator.pipeline.tasks import get_ledger

    checkpoint = get_ledger().get_checkpoint(ref)
    if checkpoint is None:
        raise click.ClickException(f"no checkpoint {ref!r} in the ledger")
    if as_json:
        click.echo(json.dumps(asdict(checkpoint), indent=2, default=str))
        return
    click.echo(
        f"{checkpoint.ref}  {checkpoint.namespace}/{checkpoint.name}  reason={checkpoint.reason} "
        f"forced={checkpoint.forced} verified={checkpoint.verified} pvc={checkpoint.pvc_name}"
    )
    for agent in checkpoint.agents:
        click.echo(
            f"  {agent.agent_id:<20} turns={agent.turns:<5} clean={agent.clean!s:<5} "
            f"{agent.session_dir}  {(agent.session_sha256 or '-')[:16]}"
        )


# -------------------------------------------------------------------------- operator


@main.command("operator")
@click.option("--manage-sandbox", is_flag=True, help="Provision each task's Sandbox and PVC.")
@click.option("--namespace", "namespaces", multiple=True, help="Watch only these namespaces.")
@click.option("--log-level", default="INFO", show_default=True)
def operator_cmd(manage_sandbox: bool, namespaces: tuple[str, ...], log_level: str) -> None:
    """Run the CalibanTask operator (kopf; kubeconfig or in-cluster credentials)."""
    configure_logging(log_level)
    from orchestrator.operator.handlers import run_operator

    run_operator(namespaces=list(namespaces) or None, manage_sandbox=manage_sandbox)


def _patch_task(task: str, patch: dict[str, Any]) -> dict[str, Any]:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from orchestrator.operator.kube import load_credentials

    namespace, name = _task_ref(task)
    load_credentials()
    api = client.CustomObjectsApi()
    try:
        result: dict[str, Any] = api.patch_namespaced_custom_object(
            "caliban.caliban-ai.dev", "v1alpha1", namespace, "calibantasks", name, patch,
            _content_type="application/merge-patch+json",
        )  # fmt: skip
    except ApiException as exc:
        raise click.ClickException(f"calibantask {task}: {exc.status} {exc.reason}") from None
    return result


@main.command("pause")
@click.argument("task")
def pause_cmd(task: str) -> None:
    """Pause NS/NAME: drain, checkpoint, suspend (sets spec.lifecycle.suspend: true)."""
    _patch_task(task, {"spec": {"lifecycle": {"suspend": True}}})
    click.echo(f"calibantask {task} pausing")


@main.command("wake")
@click.argument("task")
def wake_cmd(task: str) -> None:
    """Resume NS/NAME from its checkpoint (clears suspend and sets the wake annotation)."""
    from datetime import UTC, datetime

    from orchestrator.operator.lifecycle import WAKE_ANNOTATION

    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    _patch_task(
        task,
        {
            "metadata": {"annotations": {WAKE_ANNOTATION: stamp}},
            "spec": {"lifecycle": {"suspend": False}},
        },
    )
    click.echo(f"calibantask {task} waking")


# ------------------------------------------------------------------------------- dev


@main.group()
def dev() -> None:
    """Development: the embedded Kubernetes API and the whole stack on one machine."""
    require_extra("dev", "kmock", "the embedded Kubernetes API (drainctl dev)")


@dev.command("up")
@click.option(
    "--kubeconfig",
    type=click.Path(path_type=Path),
    default=Path("kubeconfig.yaml"),
    show_default=True,
    help="Where to write the kubeconfig for kubectl.",
)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    default=Path(".dev-stack"),
    show_default=True,
    help="Ledger, broker, volumes and logs.",
)
@click.option("--port", default=0, show_default=True, type=int, help="API port (0: any).")
@click.option(
    "--sandbox-storage",
    type=click.Choice(["v1alpha1", "v1beta1"]),
    default="v1alpha1",
    show_default=True,
    help="The Sandbox version the embedded cluster stores (as a real cluster has one).",
)
@click.option("--log-level", default="INFO", show_default=True)
def dev_up(
    kubeconfig: Path, state_dir: Path, port: int, sandbox_storage: str, log_level: str
) -> None:
    """Embedded API, operator, worker, stand-in Sandbox controller, ledger and broker."""
    configure_logging(log_level)
    from orchestrator.devcluster.up import run_dev_up

    asyncio.run(
        run_dev_up(
            kubeconfig=kubeconfig.resolve(), state_dir=state_dir.resolve(), port=port,
            sandbox_storage=sandbox_storage,
        )
    )  # fmt: skip


@dev.command("cluster")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="Port on 127.0.0.1 (0 picks a free one).",
)
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Where to write the kubeconfig for kubectl and kopf.",
)
@click.option(
    "--crd",
    "crd_files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A CRD file to serve from the start (default: the CRDs the package ships).",
)
@click.option("--log-level", default="INFO", show_default=True)
def dev_cluster(port: int, kubeconfig: Path, crd_files: tuple[Path, ...], log_level: str) -> None:
    """Run the embedded Kubernetes API alone, in the foreground, until SIGTERM or Ctrl-C."""
    from orchestrator.devcluster import DevClusterError, run_dev_cluster
    from orchestrator.devcluster.apiserver import CrdSource
    from orchestrator.devcluster.up import packaged_crds

    configure_logging(log_level)
    crds: list[CrdSource] = [*crd_files] if crd_files else [*packaged_crds()]
    try:
        run_dev_cluster(
            port,
            kubeconfig,
            crds,
            on_ready=lambda url: click.echo(
                f"Kubernetes API at {url}; kubectl --kubeconfig {kubeconfig} get ns"
            ),
        )
    except DevClusterError as exc:
        raise click.ClickException(str(exc)) from exc


# ------------------------------------------------------------------------------ demo


@main.command()
@click.option("--agents", "agent_count", default=3, show_default=True, type=click.IntRange(1, 50))
@click.option("--state-dir", type=click.Path(path_type=Path), default=None)
def demo(agent_count: int, state_dir: Path | None) -> None:
    """Run the whole story on this machine with nothing installed but the package."""
    from orchestrator.demo import run_demo

    sys.exit(run_demo(agent_count=agent_count, state_dir=state_dir, echo=click.echo))


if __name__ == "__main__":
    main()
