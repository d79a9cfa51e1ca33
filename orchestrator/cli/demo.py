"""``drainctl demo``: the whole story on this machine (``orchestrator.demo``)."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command()
@click.option(
    "--agents",
    "agent_count",
    default=3,
    show_default=True,
    type=click.IntRange(1, 50),
    help="Agents the demo daemon runs.",
)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Keep the demo's store, ledger and logs here (default: a temporary dir).",
)
def demo(agent_count: int, state_dir: Path | None) -> None:
    """Run the whole story on this machine with nothing installed but the package."""
    from orchestrator.demo import run_demo

    sys.exit(run_demo(agent_count=agent_count, state_dir=state_dir, echo=click.echo))
