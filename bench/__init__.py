"""The benchmarks: one harness, ``python -m bench`` (see ``bench.__main__``).

Each scenario of the performance budgets (docs/architecture.md) is a module (``drain``,
``pipeline``, ``delete``) that measures the real system against floors measured in the
same run (``floors``: bare processes that save atomically on SIGTERM, a no-op two-task
Celery chain, API round trips), checks that no turn was lost (``audit``), and hands
``report`` a ``Scenario``: figures, checks and raw runs, from which every sentence of
``RESULTS.md`` is computed. Processes are started and
stopped through the testing kit (``worker_agent.testing``, ``orchestrator.testing``).
"""
