"""``drainctl``: the one command line of caliban-drain.

Each subcommand imports what it needs when it runs, so ``drainctl daemon`` in a Sandbox
pod loads the daemon side only. Human output by default, ``--json`` for scripts;
errors say what was wrong and exit non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

import click


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
