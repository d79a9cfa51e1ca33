"""The consumer's configuration: read when it is used, never at import, and handed to its
tasks on their base class (``ConsumerTask``), never through the environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker_agent import consumer
from worker_agent.consumer import ConsumerConfig, ConsumerTask


def test_the_broker_is_read_when_the_app_is_configured_not_at_import() -> None:
    """Tried: ``DRAIN_BROKER_URL`` set after the module was imported (as a program that
    imports it, then decides its settings, does)."""
    code = (
        "import os, worker_agent.consumer as c; "
        "os.environ['DRAIN_BROKER_URL'] = 'redis://127.0.0.1:6399/3'; "
        "print(c.app.conf.broker_url)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAIN_")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "redis://127.0.0.1:6399/3"


def test_main_s_options_become_the_config_and_the_environment_is_left_alone(
    tmp_path: Path,
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    argv = [
        "--queue", "caliband.team-a.task-1", "--connect", "[::1]:7443",
        "--token-file", str(token), "--store", "/store",
    ]  # fmt: skip
    before = dict(os.environ)
    config, _ = consumer.options(argv, {"DRAIN_TASK_UID": "uid-1"})
    assert config == ConsumerConfig(
        socket=None, store=Path("/store"), namespace="team-a", name="task-1",
        task_uid="uid-1", connect=("::1", 7443), token_file=token, ca_file=None,
    )  # fmt: skip
    assert dict(os.environ) == before


def test_a_task_of_a_consumer_serving_no_pod_says_so() -> None:
    """Tried: a consumer task run in a process that never ran ``main`` (no pod served)."""
    assert ConsumerTask.pod is None
    with pytest.raises(RuntimeError, match="serves no pod"):
        consumer.drain(op_id="op-1", grace_secs=5.0)
