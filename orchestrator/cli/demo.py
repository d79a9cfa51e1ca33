"""``drainctl demo``: the whole story on this machine (``orchestrator.demo``)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from orchestrator.cli.errors import OperationFailed, require_extra
from orchestrator.cli.output import json_option, wants_json


@click.command()
@click.option(
    "--agents",
    "agent_count",
    default=3,
    show_default=True,
    type=click.IntRange(1, 50),
    help="Agents of the demo's task (or daemon, with --daemon-only).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the demo's cluster state, ledger, volumes and logs here (default: a "
    "temporary dir, removed at the end).",
)
@click.option(
    "--port",
    default=0,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port of the embedded Kubernetes API on 127.0.0.1 (0: any free one).",
)
@click.option(
    "--daemon-only",
    is_flag=True,
    help="Only the daemon's half: drain, SIGKILL, restart and resume one supervisor daemon "
    "(no cluster, broker or ledger).",
)
@json_option
def demo(agent_count: int, state_dir: Path | None, port: int, daemon_only: bool) -> None:
    """Run the whole story on this machine: a CalibanTask created, idle-paused, woken,
    deleted and restored on the embedded cluster, every turn accounted for.

    Exits 0 when every step happened and no completed turn was lost, 1 otherwise, 130
    when interrupted (everything it started is stopped first)."""
    if daemon_only:
        if wants_json():
            raise click.UsageError("--json is for the whole story, not --daemon-only")
        from orchestrator.demo.daemon import run_demo

        sys.exit(run_demo(agent_count=agent_count, state_dir=state_dir, echo=click.echo))
    require_extra("dev", "kmock", "the embedded Kubernetes API the demo runs on")
    from orchestrator.demo.story import DemoBusy, run_story

    try:
        code = run_story(
            agent_count=agent_count,
            state_dir=state_dir,
            port=port,
            as_json=wants_json(),
            echo=click.echo,
        )
    except DemoBusy as exc:
        raise OperationFailed(str(exc)) from None
    sys.exit(code)
