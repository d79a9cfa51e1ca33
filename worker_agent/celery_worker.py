"""Run a Celery worker in this process without Celery's command line.

``app.worker_main([...])`` parses its arguments with ``celery``'s click program, which
imports every command it could offer: the ``celery.commands`` entry points (Flower, with
tornado), ``celery shell``'s REPL (prompt_toolkit, pygments) and the rest: 272 modules
and 12 MB of a consumer's memory that a worker never uses. Every pod runs a consumer, so
a fleet of 200 tasks paid that 200 times. :func:`run_worker` builds the same
``celery.apps.worker.Worker`` the ``celery worker`` command builds (the options converted
as that command converts them) and starts it.
"""

from __future__ import annotations

from collections.abc import Sequence

from celery import Celery
from celery.utils.log import mlevel
from celery.utils.nodenames import default_nodename, host_format

from worker_agent.logformat import quiet_worker


def run_worker(
    app: Celery,
    *,
    queues: Sequence[str],
    hostname: str,
    pool: str,
    loglevel: str,
    concurrency: int | None = None,
    without_gossip: bool = False,
    without_mingle: bool = False,
) -> int:
    """Start a worker that consumes ``queues``, sends task events, and return its exit
    code once it has stopped (0 after a warm or cold shutdown, 1 after an unrecoverable
    error). ``hostname`` takes ``%h`` as ``--hostname`` does. In JSON logs the worker goes
    without its start-up banner (``logformat.quiet_worker``)."""
    worker = app.Worker(
        queues=list(queues),
        hostname=host_format(default_nodename(hostname)),
        pool_cls=pool,
        loglevel=mlevel(loglevel),
        quiet=quiet_worker(),
        concurrency=concurrency,
        task_events=True,
        without_gossip=without_gossip,
        without_mingle=without_mingle,
    )
    worker.start()
    return int(worker.exitcode or 0)
