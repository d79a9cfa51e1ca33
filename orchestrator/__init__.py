"""The orchestrator side of caliban-drain, and ``drainctl``, its command line.

``operator`` (the kopf operator for CalibanTask) · ``pipeline`` (the orchestrator's
Celery app and tasks) · ``ledger`` (the checkpoint ledger) · ``cli`` (``drainctl``) ·
``settings`` (every ``DRAIN_…`` setting) · ``demo`` (``drainctl demo``) · ``devcluster``
(the embedded Kubernetes API for development and tests; the ``dev`` extra).

Dependencies run one way: the CLI may import everything; the operator imports the
pipeline and the ledger; the pipeline imports the ledger; the ledger imports none of
them; only the CLI, the demo and the testing kit import ``devcluster``. Any of them may
import ``worker_agent`` (the contract and the client), which never imports this package.
``tests/unit/test_import_rules.py`` enforces it; docs/architecture.md draws it.
"""
