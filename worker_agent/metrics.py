"""The daemon side's Prometheus metrics, and the small HTTP server every component of
caliban-drain serves them on (``/metrics``, ``/healthz``, ``/readyz``).

The daemon is two processes: the supervisor (``drainctl daemon``, which serves the port)
and its Celery consumer (a child). The supervisor's own metrics live in
:data:`SUPERVISOR`; the consumer's in :data:`CONSUMER`, which in the consumer process is
backed by prometheus_client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, a
directory the supervisor makes and hands to the child), so a consumer restarted keeps
its counts and the supervisor serves both (:func:`daemon_registry`).

Queue wait is measured from a header every publisher stamps (:data:`SENT_AT_HEADER`,
:func:`stamp_sent_at`, connected to Celery's ``before_task_publish`` by
``contract.make_celery``, so every app of either half stamps its messages) to the moment
a worker starts the task; a message with an ETA is
counted from its ETA. Publisher and consumer clocks differ by their skew; a negative wait
is counted as 0.

This module imports ``prometheus_client`` only, never Celery (the supervisor process
loads no Celery): the orchestrator imports it (the server, the names), never the other
way round.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Final

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

log = logging.getLogger(__name__)

LOST_TURNS_NAME: Final = "caliban_drain_lost_turns"
LOST_TURNS_HELP: Final = (
    "Completed turns a check found missing (a workspace holding fewer turns than its "
    "checkpoint recorded). Must stay 0."
)
QUEUE_WAIT_NAME: Final = "caliban_drain_queue_wait_seconds"
QUEUE_WAIT_HELP: Final = (
    "Seconds from a task's publish (or its ETA) to a worker starting it, by task name."
)
QUEUE_WAIT_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
DURATION_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)

SENT_AT_HEADER: Final = "caliban_sent_at"
"""Message header: the publisher's wall clock (Unix seconds) when it sent the task."""
MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"

SUPERVISOR = CollectorRegistry()
"""Metrics the supervisor process records."""
CONSUMER = CollectorRegistry()
"""Metrics the consumer process records (multiprocess files there)."""

AGENTS_LIVE = Gauge(
    "caliban_drain_agents_live", "Agents this daemon has running now.", registry=SUPERVISOR
)
DAEMON_QUEUE_WAIT = Histogram(
    QUEUE_WAIT_NAME, QUEUE_WAIT_HELP, ["task"], buckets=QUEUE_WAIT_BUCKETS, registry=CONSUMER
)
DAEMON_RESUME_DURATION = Histogram(
    "caliban_drain_daemon_resume_duration_seconds",
    "Seconds the daemon's consumer took to resume a checkpoint's agents, by outcome "
    "(ok: every agent back; partial; failed; refused: the workspace is not the checkpoint's).",
    ["outcome"],
    buckets=DURATION_BUCKETS,
    registry=CONSUMER,
)
DAEMON_LOST_TURNS = Counter(LOST_TURNS_NAME, LOST_TURNS_HELP, registry=CONSUMER)


# ------------------------------------------------------------------------ pure parts


def lost_turns(recorded: int | None, found: int | None) -> int:
    """Completed turns missing when a checkpoint recorded ``recorded`` and the workspace
    holds ``found``: more turns (the workspace moved on) or an unknown count lose none."""
    if recorded is None or found is None:
        return 0
    return max(recorded - found, 0)


def queue_wait(sent_at: object, eta: object, started: float) -> float | None:
    """Seconds a message waited, from its sent stamp (or its ETA when later) to
    ``started``; None when it carries no stamp (a publisher that predates it)."""
    if not isinstance(sent_at, int | float) or isinstance(sent_at, bool):
        return None
    since = float(sent_at)
    if isinstance(eta, str):
        with contextlib.suppress(ValueError):
            since = max(since, datetime.fromisoformat(eta).timestamp())
    return max(started - since, 0.0)


# -------------------------------------------------------------- Celery instrumentation


def stamp_sent_at(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Celery's ``before_task_publish``: stamp the message (``contract.make_celery``
    connects it, so both halves' messages carry it)."""
    if headers is not None:
        headers.setdefault(SENT_AT_HEADER, time.time())


def observe_queue_wait(histogram: Histogram, task: Any) -> None:
    """Record ``task``'s queue wait (call from ``task_prerun``)."""
    request = task.request
    wait = queue_wait(getattr(request, SENT_AT_HEADER, None), request.eta, time.time())
    if wait is not None:
        histogram.labels(task=task.name).observe(wait)


def daemon_registry(multiproc_dir: Path | None) -> CollectorRegistry:
    """What the daemon serves: the supervisor's metrics and the consumer's files."""
    served = CollectorRegistry(auto_describe=False)
    served.register(SUPERVISOR)  # a registry is a collector of its metrics
    if multiproc_dir is not None:
        MultiProcessCollector(served, path=str(multiproc_dir))  # type: ignore[no-untyped-call]
    return served


# ------------------------------------------------------------------------ HTTP server

Check = Callable[[], str | None]
"""A health check: None when healthy, else why not (logged, never served)."""

UNAVAILABLE_BODY: Final = b"unavailable\n"
"""What a failing check answers, whatever the reason: the port is reachable from the
monitoring namespace and the kubelet, and a reason (a broker's address, an error's text)
is for the component's log, not for whoever can reach a probe."""


class ProbeLog:
    """Each route's failure reason logged once when it changes, and its recovery once."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.lock = threading.Lock()
        self.failing: dict[str, str] = {}

    def record(self, route: str, problem: str | None) -> None:
        with self.lock:
            before = self.failing.get(route)
            if problem == before:
                return
            if problem is None:
                del self.failing[route]
            else:
                self.failing[route] = problem
        if problem is None:
            log.info("probe_passing component=%s route=%s", self.what, route)
        else:
            log.warning("probe_failing component=%s route=%s reason=%s", self.what, route, problem)


class MetricsServer:
    """``/metrics`` of ``registry`` and one route per health check, on a daemon thread.
    A failing check answers 503 with :data:`UNAVAILABLE_BODY`; its reason is logged."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        checks: Mapping[str, Check],
        what: str = "component",
    ) -> None:
        routes = dict(checks)
        probe_log = ProbeLog(what)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.partition("?")[0]
                if path == "/metrics":
                    self._answer(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                    return
                check = routes.get(path)
                if check is None:
                    self._answer(404, b"not found\n", "text/plain")
                    return
                try:
                    problem = check()
                except Exception as exc:  # a check that breaks is a failed check
                    problem = f"check failed: {exc}"
                probe_log.record(path, problem)
                if problem is None:
                    self._answer(200, b"ok\n", "text/plain")
                else:
                    self._answer(503, UNAVAILABLE_BODY, "text/plain")

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # one line per scrape would drown the logs

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="caliban-metrics", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def start(self) -> MetricsServer:
        self.thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve(
    host: str, port: int, registry: CollectorRegistry, checks: Mapping[str, Check], what: str
) -> MetricsServer | None:
    """Start serving, or log why not and answer None (metrics never stop a component)."""
    try:
        server = MetricsServer(host, port, registry, checks, what).start()
    except OSError as exc:
        log.error("metrics_unavailable component=%s address=%s:%d error=%s", what, host, port, exc)
        return None
    log.info("metrics_serving component=%s url=http://%s:%d/metrics", what, host, server.port)
    return server
