"""What a pod's processes cost in CPU when they stop, and the interpreter's share of it.

A pod: a real ``drainctl daemon`` with its Celery consumer (Redis database ``REDIS_DB``)
and one scripted agent, working, then stopped with SIGTERM, ``PODS`` times. The CPU from
SIGTERM to exit is the pod's processes' CPU (``RUSAGE_CHILDREN``, which holds every
reaped descendant) less what they had used before the SIGTERM (psutil).

The interpreter's teardown alone: for the daemon (``drainctl daemon``'s imports), the
Celery consumer (its imports and its worker's) and an agent (``worker_agent.worker``), a
child process loads what the running process loads and ends, ``REPEAT`` times each way:
the ordinary way (CPython's finalization: ``atexit`` hooks, then every module and object
freed) and through ``worker_agent.exiting.exit_now`` (the threads waited for and the
``atexit`` hooks run, then ``os._exit``). Each child's CPU (user + system) comes from
``RUSAGE_CHILDREN``; the difference of the medians is what the teardown costs.

Run: ``python -m bench.exit_cost`` (prints Markdown; needs the Redis on 127.0.0.1:6379).
"""

from __future__ import annotations

import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from orchestrator.testing import flushed_redis
from worker_agent.children import descendants
from worker_agent.testing import DaemonProcess, wait_until

REPEAT = 9
PODS = 5
REDIS_DB = 10
LOADS = {
    "daemon": "import orchestrator.cli.daemon, worker_agent.server, worker_agent.settings",
    "consumer": (
        "import worker_agent.consumer, celery.apps.worker, celery.worker.consumer, "
        "celery.concurrency.solo, kombu.transport.redis; "
        "worker_agent.consumer.app.loader.import_default_modules()"
    ),
    "agent": "import worker_agent.worker",
}
EXIT_NOW = "; from worker_agent.exiting import exit_now; exit_now(0)"


def child_cpu_ms(code: str) -> float:
    """Median CPU milliseconds of ``REPEAT`` children running ``code``."""
    samples = []
    for _ in range(REPEAT):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", code], check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        used = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        samples.append(used * 1000)
    return statistics.median(samples)


def pod_stop_cpu_ms(root: Path, broker: str, index: int) -> float:
    """CPU milliseconds a working pod's processes use from SIGTERM to exit."""
    env = {"DRAIN_BROKER_URL": broker, "DRAIN_RESULT_BACKEND": broker}
    daemon = DaemonProcess(root / f"pod{index}", queue=f"caliband.bench.exit{index}", env=env)
    daemon.start()
    try:
        daemon.spawn_working(1, "turns=100000,turn_ms=1000", 1)
        wait_until(lambda: " ready." in daemon.log_text(), 60, "the consumer to be ready")
        time.sleep(1)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        used_before = 0.0
        for pid in [daemon.pid, *descendants(daemon.pid)]:
            times = psutil.Process(pid).cpu_times()
            used_before += times.user + times.system + times.children_user + times.children_system
    finally:
        daemon.stop(60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return (used - used_before) * 1000


def main() -> None:
    broker = flushed_redis(6379, REDIS_DB)
    with tempfile.TemporaryDirectory(prefix="exit-cost-") as tmp:
        pods = [pod_stop_cpu_ms(Path(tmp), broker, i) for i in range(PODS)]
    print(f"A pod's stop (daemon, consumer, 1 agent), SIGTERM → exit, {PODS} pods: "
          f"median **{statistics.median(pods):.0f} ms** of CPU "
          f"({', '.join(f'{p:.0f}' for p in pods)} ms)\n")  # fmt: skip
    rows = []
    for name, load in LOADS.items():
        ordinary, fast = child_cpu_ms(load), child_cpu_ms(load + EXIT_NOW)
        rows.append((name, ordinary, fast))
    print(f"Python {platform.python_version()}, {REPEAT} children each way, medians\n")
    print("| process | ordinary exit | `exit_now` | teardown |")
    print("|---|---:|---:|---:|")
    for name, ordinary, fast in rows:
        print(f"| {name} | {ordinary:.0f} ms | {fast:.0f} ms | {ordinary - fast:.0f} ms |")


if __name__ == "__main__":
    main()
