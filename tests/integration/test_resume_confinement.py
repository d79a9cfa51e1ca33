"""``resume`` and ``spawn`` with ``spec.resume_session`` only ever accept an agent dir
of this store: every path that escapes it, or is not an agent dir, is refused with a
message naming the path, and nothing on disk changes.

The escape targets hold a valid-looking ``session.json``, so a confinement check that
let them through would really resume a conversation instead of failing by accident.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import DaemonProcess, short_tmp
from worker_agent import layout
from worker_agent.client import ControlError, SupervisorClient
from worker_agent.proto import AgentStatus

Snapshot = dict[str, tuple[str, int, int]]


def snapshot(root: Path) -> Snapshot:
    """Every entry under ``root`` (symlinks not followed): type, size and mtime."""
    entries: Snapshot = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            info = path.lstat()
            kind = "link" if stat.S_ISLNK(info.st_mode) else "dir" if path.is_dir() else "file"
            entries[str(path.relative_to(root))] = (kind, info.st_size, info.st_mtime_ns)
    return entries


def fake_session(directory: Path, agent_id: str) -> None:
    directory.mkdir(parents=True)
    doc = {"version": 1, "agent_id": agent_id, "turns": 1, "messages": []}
    layout.session_file(directory).write_text(json.dumps(doc))


@dataclass(frozen=True)
class Store:
    daemon: DaemonProcess
    root: Path
    """The store, resolved."""
    outside: Path
    """A directory outside the store that looks like an agent dir (``evil``)."""
    real: str
    """A drained agent of the store, so the store is not empty."""


@pytest.fixture(scope="module")
def store() -> Iterator[Store]:
    with short_tmp() as tmp:
        daemon = DaemonProcess(tmp).start()
        try:
            with daemon.client(timeout=30) as client:
                real = client.spawn(provider="scripted", model="turns=1,turn_ms=10").id
                daemon.wait_for_status([real], {AgentStatus.IDLE}, timeout=20)
                assert client.drain(grace_secs=5)[0].clean
            root = daemon.store.resolve()
            outside = tmp / "outside" / "evil"
            fake_session(outside, "evil")
            (root / "agents" / "evil").symlink_to(outside, target_is_directory=True)
            yield Store(daemon, root, outside, real)
        finally:
            daemon.stop()


@dataclass(frozen=True)
class Refusal:
    path: Callable[[Store], str]
    kind: str
    says: str
    """A fragment of the message beside the path itself."""


CASES = [
    pytest.param(
        Refusal(lambda s: "/etc", "internal", "outside the store"), id="absolute_path_/etc"
    ),
    pytest.param(
        Refusal(lambda s: str(s.outside), "internal", "outside the store"),
        id="absolute_path_of_a_session_dir_outside_the_store",
    ),
    pytest.param(
        Refusal(lambda s: "../outside/evil", "internal", "outside the store"),
        id="relative_dotdot_escaping_the_store",
    ),
    pytest.param(
        Refusal(lambda s: "agents/../../outside/evil", "internal", "outside the store"),
        id="relative_agents_then_dotdot_escaping_the_store",
    ),
    pytest.param(
        Refusal(lambda s: "agents/evil", "internal", "outside the store"),
        id="relative_symlink_in_agents_pointing_outside",
    ),
    pytest.param(
        Refusal(lambda s: str(s.root / "agents" / "evil"), "internal", "outside the store"),
        id="absolute_symlink_in_agents_pointing_outside",
    ),
    pytest.param(
        Refusal(lambda s: ".", "internal", "is not an agent directory"),
        id="store_root_as_dot",
    ),
    pytest.param(
        Refusal(lambda s: str(s.root), "internal", "is not an agent directory"),
        id="store_root_absolute",
    ),
    pytest.param(
        Refusal(lambda s: "agents", "internal", "is not an agent directory"),
        id="store_agents_dir",
    ),
    pytest.param(
        Refusal(lambda s: f"agents/{s.real}/session.json", "internal", "not an agent directory"),
        id="file_inside_an_agent_dir",
    ),
    pytest.param(
        Refusal(lambda s: "agents/.hidden", "internal", "is not an agent directory"),
        id="agents_entry_with_invalid_id",
    ),
    pytest.param(
        Refusal(lambda s: "agents/agent-000000000000", "not_found", "does not exist"),
        id="nonexistent_agent_dir",
    ),
    pytest.param(
        Refusal(lambda s: f"agents/{s.real}\x00/../evil", "internal", "NUL byte"),
        id="NUL_byte_in_path",
    ),
]


def request(verb: str, path: str) -> tuple[str, dict[str, object]]:
    if verb == "resume":
        return "resume", {"session_dir": path}
    spec = {"provider": "scripted", "model": "turns=1,turn_ms=10", "resume_session": path}
    return "spawn", {"spec": spec}


@pytest.mark.parametrize("verb", ["resume", "spawn_resume_session"])
@pytest.mark.parametrize("refusal", CASES)
def test_session_dir_outside_the_store_is_refused(
    store: Store, refusal: Refusal, verb: str
) -> None:
    path = refusal.path(store)
    before = snapshot(store.root), snapshot(store.outside.parent)
    records_before = store.daemon.records()
    kind, fields = request(verb, path)

    with store.daemon.client(timeout=30) as client, pytest.raises(ControlError) as refused:
        client.call(kind, **fields)

    body = refused.value.body
    assert body.kind == refusal.kind, body
    assert refusal.says in body.message, body
    if "\x00" not in path:
        assert repr(path) in body.message, body  # the message names the path as given
    else:
        assert "session_dir" in body.message, body
    assert (snapshot(store.root), snapshot(store.outside.parent)) == before
    assert store.daemon.records() == records_before


def test_the_store_still_resumes_its_own_agent(store: Store) -> None:
    """The refusals above are confinement, not a broken resume: a real one works."""
    with store.daemon.client(timeout=30) as client:
        resumed = client.resume(f"agents/{store.real}")
        assert resumed.id == store.real
    store.daemon.wait_for_status([store.real], {AgentStatus.IDLE}, timeout=20)
    with store.daemon.client(timeout=30) as client:
        assert client.drain(grace_secs=5)[0].clean


def test_a_manifest_behind_a_symlink_cannot_point_rm_outside_the_store() -> None:
    with short_tmp() as tmp:
        victim = tmp / "victim"
        victim.mkdir()
        (victim / "precious.txt").write_text("keep me")
        planted = tmp / "planted"
        planted.mkdir()
        now = time.time()
        manifest = {
            "id": "evil",
            "status": "drained",
            "spec": {},
            "session_dir": str(victim),
            "created_at": now,
            "updated_at": now,
        }
        layout.manifest_file(planted).write_text(json.dumps(manifest))
        agents = tmp / "store" / "agents"
        agents.mkdir(parents=True)
        (agents / "evil").symlink_to(planted, target_is_directory=True)
        daemon = DaemonProcess(tmp).start()
        try:
            with SupervisorClient(socket_path=daemon.socket, timeout=30) as client:
                ids = {r.id for r in client.agents()}
                if "evil" in ids:
                    reply = client.call_raw(b'{"kind": "rm", "id": "evil", "force": true}')
                    assert reply["kind"] == "error", reply
        finally:
            daemon.stop()
        assert (victim / "precious.txt").read_text() == "keep me"


def test_a_manifest_whose_session_dir_points_outside_is_not_trusted() -> None:
    """Tried: a worker rewrote its own manifest.json so session_dir names a dir outside."""
    with short_tmp() as tmp:
        victim = tmp / "victim"
        victim.mkdir()
        (victim / "precious.txt").write_text("keep me")
        agent_dir = tmp / "store" / "agents" / "agent-rewritten"
        agent_dir.mkdir(parents=True)
        now = time.time()
        manifest = {
            "id": "agent-rewritten",
            "status": "drained",
            "spec": {},
            "session_dir": str(victim),
            "created_at": now,
            "updated_at": now,
        }
        layout.manifest_file(agent_dir).write_text(json.dumps(manifest))
        daemon = DaemonProcess(tmp).start()
        try:
            with SupervisorClient(socket_path=daemon.socket, timeout=30) as client:
                [record] = client.agents()
                assert record.session_dir == str(agent_dir)
                reply = client.call_raw(b'{"kind": "rm", "id": "agent-rewritten", "force": true}')
                assert reply["kind"] == "removed", reply
        finally:
            daemon.stop()
        assert (victim / "precious.txt").read_text() == "keep me"
        assert not agent_dir.exists()
