"""``drainctl``: the one command line of caliban-drain.

A module per command group — ``daemon`` (``daemon``, ``sources``, ``agents …``), ``pipeline``
(``drain``, ``resume``, ``worker``, ``flower``), ``ledger`` (``ledger ls|show``,
``db upgrade``), ``operator`` (``operator``, ``pause``, ``wake``), ``dev``
(``dev up|cluster``), ``audit`` and ``demo`` — registered on ``main`` here. What they share lives
in ``output`` (``--json``, ``--log-level``, ``NS/NAME``, printing) and ``errors``
(``ExitCode`` and the one mapping from a failure to an ``Error:`` line).

These modules import only click at import time; each command imports what it needs
when it runs, so ``drainctl daemon`` in a Sandbox pod loads the daemon side only and
never kopf, Celery, SQLAlchemy, Flower or kmock. ``docs/cli.md`` documents every
command, the ``--json`` convention and the exit codes.
"""

from __future__ import annotations

import click

from orchestrator.cli.audit import audit_cmd
from orchestrator.cli.daemon import agents, daemon, sources
from orchestrator.cli.demo import demo
from orchestrator.cli.dev import dev
from orchestrator.cli.errors import DrainctlGroup, ExitCode
from orchestrator.cli.ledger import db, ledger
from orchestrator.cli.operator import operator_cmd, pause_cmd, wake_cmd
from orchestrator.cli.pipeline import drain_cmd, flower_cmd, resume_cmd, worker_cmd

__all__ = ["ExitCode", "main"]


@click.group(cls=DrainctlGroup)
@click.version_option(package_name="caliban-drain")
def main() -> None:
    """caliban-drain: never lose an agent's work to a delete or an idle pause.

    Exit codes: 0 done, 1 the operation failed, 2 usage or configuration, 3 timed out
    waiting, 4 cannot reach the broker, database, Kubernetes API or daemon.
    """


for command in (
    daemon,
    sources,
    agents,
    drain_cmd,
    resume_cmd,
    worker_cmd,
    flower_cmd,
    ledger,
    db,
    operator_cmd,
    pause_cmd,
    wake_cmd,
    audit_cmd,
    dev,
    demo,
):
    main.add_command(command)


if __name__ == "__main__":
    main()
