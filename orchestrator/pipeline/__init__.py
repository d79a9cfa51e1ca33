"""The orchestrator's half of the Celery pipeline.

``app`` (the orchestrator's Celery app, configured from the shared contract in
``worker_agent.contract``), ``tasks`` (``record_checkpoint``, ``record_resume``, activity
intake and the deadline sweeper, run by ``drainctl worker``) and ``start`` (beginning an
operation: the ledger row first, then the chain; waiting for it to end).

Imports ``worker_agent.contract`` and ``orchestrator.ledger``; never the operator, the
CLI or the embedded Kubernetes API.
"""
