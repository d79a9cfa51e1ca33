"""The store's on-disk names, pinned: a change here breaks every existing store and every
worker written against DESIGN §2, so it must be deliberate."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from worker_agent import layout

STORE = Path("/pvc")
AGENT = STORE / "agents" / "agent-1"


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        pytest.param(lambda: layout.agents_dir(STORE), "/pvc/agents", id="agents"),
        pytest.param(lambda: layout.agent_dir(STORE, "agent-1"), "/pvc/agents/agent-1", id="agent"),
        pytest.param(lambda: layout.manifest_file(AGENT), f"{AGENT}/manifest.json", id="manifest"),
        pytest.param(lambda: layout.session_file(AGENT), f"{AGENT}/session.json", id="session"),
        pytest.param(lambda: layout.transcript_file(AGENT), f"{AGENT}/stdout.ndjson", id="stdout"),
        pytest.param(lambda: layout.stderr_file(AGENT), f"{AGENT}/stderr.log", id="stderr"),
        pytest.param(lambda: layout.lock_file(AGENT), f"{AGENT}/worker.lock", id="lock"),
        pytest.param(lambda: layout.run_dir(STORE), "/pvc/run", id="run"),
        pytest.param(
            lambda: layout.drain_deadline_file(STORE), "/pvc/run/drain_deadline", id="deadline"
        ),
        pytest.param(lambda: layout.default_socket(STORE), "/pvc/run/caliband.sock", id="socket"),
        pytest.param(lambda: layout.ops_dir(STORE), "/pvc/ops", id="ops"),
        pytest.param(
            lambda: layout.op_entry(STORE, "op-7", "drain"), "/pvc/ops/op-7.drain.json", id="op"
        ),
        pytest.param(
            lambda: layout.temp_file(AGENT / "session.json", 42),
            f"{AGENT}/.session.json.42.tmp",
            id="temp",
        ),
    ],
)
def test_each_store_path_keeps_its_on_disk_name(path: Callable[[], Path], expected: str) -> None:
    assert str(path()) == expected


def test_the_daemon_modules_name_files_through_layout() -> None:
    """No module of the daemon spells a store file name itself (layout is the one place)."""
    names = [
        '"manifest.json"', '"session.json"', '"stdout.ndjson"', '"stderr.log"',
        '"worker.lock"', '"drain_deadline"', '"caliband.sock"',
    ]  # fmt: skip
    package = Path(layout.__file__).parent
    offenders = [
        f"{source.name}: {name}"
        for source in sorted(package.glob("*.py"))
        if source.name != "layout.py"
        for name in names
        if name in source.read_text()
    ]
    assert offenders == []
