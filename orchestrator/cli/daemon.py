"""``drainctl daemon``, ``drainctl sources`` and ``drainctl agents …``: the daemon side of
the command line.

This is what runs in a Sandbox pod, so it imports ``worker_agent`` only, and only inside
the commands: neither Celery, SQLAlchemy, kopf, Flower nor the embedded Kubernetes API
is loaded by ``drainctl daemon`` (a test pins it). ``agents`` talks the NDJSON control
protocol to a running daemon; a refused request exits 1, an unreachable socket 4.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import click

from orchestrator.cli.output import configure_logging, emit, json_option, log_level_option


@click.command()
@click.option("--store", type=click.Path(path_type=Path), help="Agent store (the PVC root).")
@click.option("--socket", "socket_path", type=click.Path(path_type=Path), help="Control socket.")
@click.option("--listen", help="HOST:PORT for the TLS network transport.")
@click.option("--token-file", type=click.Path(path_type=Path), help="Bearer token (network).")
@click.option("--tls-cert", type=click.Path(path_type=Path), help="TLS certificate (PEM).")
@click.option("--tls-key", type=click.Path(path_type=Path), help="TLS private key (PEM).")
@click.option("--worker-command", help="Worker command template (see docs/daemon.md).")
@click.option("--drain-grace", type=float, help="Grace in seconds when the daemon is stopped.")
@click.option("--kill-grace", type=float, help="Seconds between SIGTERM and SIGKILL for kill.")
@click.option("--queue", help="caliband.<namespace>.<name>: also run this queue's Celery consumer.")
@click.option("--broker", "broker_url", help="The consumer's broker URL (else DRAIN_BROKER_URL).")
@click.option("--task-uid", help="The CalibanTask uid this pod serves (sent in heartbeats).")
@click.option("--max-agents", type=int, help="Agents this daemon keeps at most (default 300).")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Port of /metrics, /healthz and /readyz (default 9102; 0: none).",
)
@click.option("--metrics-host", help="Address they are served on (default 0.0.0.0).")
@click.option("--initial-agents", type=int, help="Agents to spawn into an empty store.")
@click.option("--initial-provider", help="Provider of the initial agents.")
@click.option("--initial-model", help="Model of the initial agents.")
@click.option("--initial-prompt", help="Initial prompt of the initial agents.")
@log_level_option
def daemon(log_level: str, **options: Any) -> None:
    """Run the supervisor daemon in the foreground (SIGTERM drains, then exits).

    Options not given fall back to DRAIN_DAEMON_* variables.
    """
    from worker_agent.exiting import exit_now
    from worker_agent.server import run_daemon
    from worker_agent.settings import DaemonSettings

    configure_logging(log_level)
    names = {
        "socket_path": "socket",
        "drain_grace": "drain_grace_secs",
        "kill_grace": "kill_grace_secs",
    }
    overrides = {names.get(k, k): v for k, v in options.items() if v is not None}
    # ConfigError and ValidationError become one line in errors.DrainctlGroup.
    asyncio.run(run_daemon(DaemonSettings(**overrides)))
    # Drained, stopped and logged: skip the interpreter's teardown (``exiting``).
    exit_now(0)


@click.command()
@click.option(
    "--into",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory each source is cloned under, as <into>/<name>.",
)
@log_level_option
def sources(log_level: str, into: Path) -> None:
    """Clone the Workspace's git sources (JSON in CALIBAN_SOURCES) that are not there yet.

    The Sandbox pod's init container; a checkout already on the volume is kept, never
    fetched again.
    """
    import os

    from orchestrator.cli.errors import OperationFailed
    from worker_agent.sources import SourceError, clone_all, sources_from_env

    configure_logging(log_level)
    try:
        clone_all(into, sources_from_env(os.environ))
    except SourceError as exc:
        raise OperationFailed(str(exc)) from None


class _AgentsContext:
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path

    def call(self, kind: str, **fields: Any) -> Any:
        from worker_agent.client import SupervisorClient

        # ConnectionError (exit 4) and ControlError (exit 1) are mapped in errors.py.
        with SupervisorClient(socket_path=self.socket_path, timeout=None) as client:
            return client.call(kind, **fields)


@click.group()
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(path_type=Path),
    envvar="DRAIN_DAEMON_SOCKET",
    required=True,
    help="The daemon's control socket (else DRAIN_DAEMON_SOCKET).",
)
@json_option
@click.pass_context
def agents(ctx: click.Context, socket_path: Path) -> None:
    """Talk to a running daemon: ls, spawn, prompt, kill, rm, status, drain, resume."""
    ctx.obj = _AgentsContext(socket_path)


@agents.command("ls")
@json_option
@click.pass_obj
def agents_ls(obj: _AgentsContext) -> None:
    """List agents."""
    reply = obj.call("list")
    rows = [f"{'ID':<20} {'STATUS':<9} {'TURNS':>5}  {'PROVIDER':<9} SESSION"]
    for record in reply.agents:
        rows.append(
            f"{record.id:<20} {record.status.value:<9} {record.turns:>5}  "
            f"{record.spec.provider or '(default)':<9} {record.session_dir}"
        )
    emit(reply, "\n".join(rows) if reply.agents else "no agents")


@agents.command("spawn")
@click.option(
    "--provider", default="scripted", show_default=True, help="The worker's model provider."
)
@click.option("--model", default=None, help='Model; for scripted: "turns=N,turn_ms=M".')
@click.option("--name", "label", default=None, help="A human name for the agent (its label).")
@click.option("--prompt", "initial_prompt", default=None, help="Initial prompt.")
@click.option("--resume-session", default=None, help="Continue this session dir instead.")
@click.option(
    "--count",
    default=1,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="How many agents to start (one reply each).",
)
@json_option
@click.pass_obj
def agents_spawn(obj: _AgentsContext, /, count: int, **spec: Any) -> None:
    """Start agents (or continue one with --resume-session)."""
    clean = {k: v for k, v in spec.items() if v is not None}
    for _ in range(count):
        reply = obj.call("spawn", spec=clean)
        emit(reply, f"spawned {reply.id}  endpoint {reply.endpoint}")


@agents.command("prompt")
@click.argument("agent_id")
@click.argument("text")
@json_option
@click.pass_obj
def agents_prompt(obj: _AgentsContext, agent_id: str, text: str) -> None:
    """Send TEXT to live agent AGENT_ID as its next turn (through its attach endpoint)."""
    from worker_agent.client import SupervisorClient

    # ConnectionError (exit 4), ControlError and PromptRefused (exit 1): errors.py.
    with SupervisorClient(socket_path=obj.socket_path, timeout=60) as client:
        queued = client.prompt(agent_id, text)
    emit({"id": agent_id, "queued": queued}, f"prompt queued for {agent_id} ({queued} waiting)")


@agents.command("kill")
@click.argument("agent_id")
@json_option
@click.pass_obj
def agents_kill(obj: _AgentsContext, agent_id: str) -> None:
    """Stop agent AGENT_ID abruptly (SIGTERM, SIGKILL after the kill grace)."""
    reply = obj.call("kill", id=agent_id)
    emit(reply, f"killed {reply.id} (exit {reply.exit})")


@agents.command("rm")
@click.argument("agent_id")
@click.option("--force", is_flag=True, help="Kill a live agent first.")
@json_option
@click.pass_obj
def agents_rm(obj: _AgentsContext, agent_id: str, force: bool) -> None:
    """Remove agent AGENT_ID and its session dir."""
    reply = obj.call("rm", id=agent_id, force=force)
    emit(reply, f"removed {reply.id}")


@agents.command("status")
@json_option
@click.pass_obj
def agents_status(obj: _AgentsContext) -> None:
    """The daemon's pid, agent count, uptime and endpoint."""
    reply = obj.call("status")
    emit(
        reply,
        f"pid {reply.pid}  agents {reply.agents}  up {reply.uptime_secs}s  {reply.endpoint}",
    )


@agents.command("drain")
@click.option(
    "--grace",
    "grace_secs",
    default=30.0,
    show_default=True,
    type=float,
    help="Seconds the agents get to finish their turn before SIGKILL.",
)
@json_option
@click.pass_obj
def agents_drain(obj: _AgentsContext, grace_secs: float) -> None:
    """Checkpoint, then stop every agent; print one resume reference per agent."""
    from worker_agent.proto import MAX_GRACE_SECS, Duration

    if not 0 <= grace_secs <= MAX_GRACE_SECS:
        raise click.BadParameter(f"must be 0 to {MAX_GRACE_SECS:.0f} seconds", param_hint="--grace")
    reply = obj.call("drain", grace=Duration.of(grace_secs).model_dump())
    rows = [f"{'ID':<20} {'TURNS':>5} {'CLEAN':<5} {'EXIT':>4}  SESSION  SHA256"]
    for ref in reply.agents:
        rows.append(
            f"{ref.id:<20} {ref.turns:>5} {ref.clean!s:<5} {ref.exit!s:>4}  {ref.session_dir}  "
            f"{(ref.session_sha256 or '-')[:16]}" + (f"  ({ref.error})" if ref.error else "")
        )
    emit(reply, "\n".join(rows))


@agents.command("resume")
@click.argument("session_dirs", nargs=-1, required=True)
@json_option
@click.pass_obj
def agents_resume(obj: _AgentsContext, session_dirs: tuple[str, ...]) -> None:
    """Continue the persisted conversations in SESSION_DIRS (absolute or relative to the
    store)."""
    for session_dir in session_dirs:
        reply = obj.call("resume", session_dir=session_dir)
        emit(reply, f"resumed {reply.id}  endpoint {reply.endpoint}")
