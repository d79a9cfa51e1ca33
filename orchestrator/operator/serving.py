"""The operator's ``/metrics`` (``DRAIN_METRICS_HOST``:``DRAIN_METRICS_PORT``, 9100):
a kopf startup handler starts the server and has the ledger count what this process
finishes (``orchestrator.metrics``). Its probes are kopf's own liveness endpoint
(``drainctl operator --liveness``), not served here.
"""

from __future__ import annotations

from typing import Any

import kopf

from orchestrator import metrics
from orchestrator.settings import get_settings
from worker_agent.metrics import MetricsServer, serve

_server: list[MetricsServer] = []


@kopf.on.startup()
def serve_metrics(**_: Any) -> None:
    metrics.count_outcomes()
    settings = get_settings()
    if settings.metrics_port and not _server:
        server = serve(
            settings.metrics_host, settings.metrics_port, metrics.REGISTRY, {}, "operator"
        )
        if server is not None:
            _server.append(server)


@kopf.on.cleanup()
def stop_metrics(**_: Any) -> None:
    while _server:
        _server.pop().close()
