"""``DRAIN_LOG_FORMAT`` as a user sets it wrong: every ``drainctl`` process refuses to
start with one line naming the variable, exit 2, no traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from orchestrator.cli.errors import ExitCode
from worker_agent.testing import DRAINCTL, child_env


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(["operator"], id="operator"),
        pytest.param(["daemon", "--store", "{tmp}/store", "--socket", "{tmp}/ctl.sock"],
                     id="daemon"),
        pytest.param(["audit", "--volumes", "{tmp}"], id="audit"),
    ],
)  # fmt: skip
def test_a_log_format_that_is_not_text_or_json_is_one_line_and_exit_2(
    command: list[str], tmp_path: Path
) -> None:
    argv = [*DRAINCTL, *(part.replace("{tmp}", str(tmp_path)) for part in command)]
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, check=False,
        env=child_env({"DRAIN_LOG_FORMAT": "xml",
                       "DRAIN_DATABASE_URL": f"sqlite:///{tmp_path}/ledger.db"}),
    )  # fmt: skip
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert result.stderr.splitlines() == [
        "Error: invalid settings: DRAIN_LOG_FORMAT: Input should be 'text' or 'json' "
        "(got 'xml'); fix the environment variable or option"
    ]
    assert not (tmp_path / "store").exists()  # refused before the daemon touched its store
