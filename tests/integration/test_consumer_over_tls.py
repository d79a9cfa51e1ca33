"""The daemon-side consumer driving a daemon over TCP+TLS with upstream's bearer preamble
(``--connect``), as it would drive a caliband: a drain through the whole pipeline
(``drainctl drain`` → the orchestrator worker → the consumer → the daemon's TLS listener)
records a verified checkpoint, and a resume through it brings the agents back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.integration.test_network_transport import HOST, TOKEN, free_port, write_self_signed
from tests.pipeline_support import Stack, fresh_sqlite, pipeline_broker
from tests.support import DaemonProcess, wait_until
from worker_agent.testing import Subprocess

QUEUE = "caliband.team-a.task-1"


def consumer(stack: Stack, *args: str) -> Subprocess:
    argv = [sys.executable, "-m", "worker_agent.consumer", "--queue", QUEUE, *args]
    return Subprocess(argv, stack.root / "consumer.log", stack.full_env())


def test_a_drain_and_a_resume_reach_a_tls_daemon_through_the_preamble(tmp_short: Path) -> None:
    cert, key, token_file = tmp_short / "tls.crt", tmp_short / "tls.key", tmp_short / "token"
    write_self_signed(cert, key)
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    with pipeline_broker("redis") as broker:
        stack = Stack(tmp_short, broker.url, fresh_sqlite(tmp_short), results=broker.results)
        (tmp_short / "store").mkdir()
        daemon = DaemonProcess(
            tmp_short / "store", "--listen", f"{HOST}:{port}", "--token-file", str(token_file),
            "--tls-cert", str(cert), "--tls-key", str(key),
        ).start()  # fmt: skip
        stack.daemons.append(daemon)
        stack.start_worker()
        remote = consumer(
            stack, "--connect", f"{HOST}:{port}", "--token-file", str(token_file),
            "--ca-file", str(cert), "--store", str(daemon.store),
        )  # fmt: skip
        remote.launch()
        try:
            ids = daemon.spawn_working(2, "turns=100000,turn_ms=50", 1)
            drained = stack.drainctl("drain", "team-a/task-1", "--grace", "10", "--wait",
                                     "--timeout", "90")  # fmt: skip
            assert drained.returncode == 0, drained.stderr + remote.log_tail()
            checkpoint = stack.ledger.get_checkpoint(drained.stdout.strip())
            assert checkpoint is not None and checkpoint.verified
            assert sorted(a.agent_id for a in checkpoint.agents) == sorted(ids)
            turns = {a.agent_id: a.turns for a in checkpoint.agents}
            resumed = stack.drainctl("resume", "team-a/task-1", "--checkpoint", checkpoint.ref,
                                     "--wait", "--timeout", "90")  # fmt: skip
            assert resumed.returncode == 0, resumed.stderr + remote.log_tail()
            wait_until(
                lambda: all(r.turns > turns[r.id] for r in daemon.records().values()),
                60,
                "the resumed agents to take new turns",
            )
        finally:
            remote.stop(30)
            stack.close()


def test_bad_connect_arguments_are_refused_in_one_line(tmp_short: Path) -> None:
    """Tried: a --connect without a port, with a port out of range, without a token file,
    with an empty token file, with both --socket and --connect, and a queue that is not
    a daemon's."""
    empty = tmp_short / "empty"
    empty.write_text("\n")
    cases = [
        (["--connect", "127.0.0.1"], "is not HOST:PORT"),
        (["--connect", "127.0.0.1:70000"], "is not HOST:PORT"),
        (["--connect", "127.0.0.1:7443"], "needs --token-file"),
        (["--connect", "127.0.0.1:7443", "--token-file", str(empty)], "is empty"),
        (["--connect", "127.0.0.1:7443", "--socket", "/tmp/x.sock"], "not allowed with"),
        (["--queue", "tasks.default", "--socket", "/tmp/x.sock"], "is not caliband."),
    ]
    for args, says in cases:
        done = subprocess.run(
            [sys.executable, "-m", "worker_agent.consumer", "--queue", QUEUE,
             "--store", str(tmp_short), *args],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 2, (args, done.stderr)
        assert says in done.stderr.splitlines()[-1], (args, done.stderr)
        assert "Traceback" not in done.stderr
