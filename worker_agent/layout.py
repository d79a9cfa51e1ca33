"""The store's on-disk names: the one place every file and directory of a store is spelled.

A store (the workspace volume's root) holds::

    <store>/agents/<id>/manifest.json      the AgentRecord, written atomically by the daemon
    <store>/agents/<id>/session.json       the resumable conversation, written by the worker
    <store>/agents/<id>/stdout.ndjson      the worker's append-only TurnEvent transcript
    <store>/agents/<id>/stderr.log         the worker's diagnostics
    <store>/agents/<id>/worker.lock        flock held by the worker for as long as it runs
    <store>/run/drain_deadline             the deadline of the drain in progress (Unix secs)
    <store>/run/caliband.sock              the control socket, unless ``--socket`` says else
    <store>/ops/<op_id>.<verb>.json        the consumer's journal of completed operations

and, beside any file written atomically, ``.<name>.<pid>.tmp`` while it is being written.

Only names live here: constants and pure functions of paths that touch no disk, so the
daemon, the reference worker (which must start fast), the consumer, the demo, tests and
benchmarks all agree on them. Standard library only; imports nothing of this package.
Which agent ids are valid and which directories may be trusted is ``store``'s business.
"""

from __future__ import annotations

from pathlib import Path

AGENTS_DIR = "agents"
MANIFEST_FILE = "manifest.json"
SESSION_FILE = "session.json"
TRANSCRIPT_FILE = "stdout.ndjson"
STDERR_FILE = "stderr.log"
LOCK_FILE = "worker.lock"
RUN_DIR = "run"
DRAIN_DEADLINE_FILE = "drain_deadline"
DAEMON_LOCK_FILE = "daemon.lock"
"""Under ``run/``: held exclusively (``flock``) by the one daemon that serves the store."""
DEFAULT_SOCKET_FILE = "caliband.sock"
AGENT_SOCKET_FILE = "agent.sock"
"""In an agent's directory: the socket its worker binds, its attach endpoint."""
OPS_DIR = "ops"


def agents_dir(store: Path) -> Path:
    """The directory holding one directory per agent."""
    return store / AGENTS_DIR


def agent_dir(store: Path, agent_id: str) -> Path:
    """An agent's directory (its session dir); ``agent_id`` is not validated here."""
    return store / AGENTS_DIR / agent_id


def manifest_file(directory: Path) -> Path:
    return directory / MANIFEST_FILE


def session_file(directory: Path) -> Path:
    return directory / SESSION_FILE


def transcript_file(directory: Path) -> Path:
    return directory / TRANSCRIPT_FILE


def stderr_file(directory: Path) -> Path:
    return directory / STDERR_FILE


def lock_file(directory: Path) -> Path:
    return directory / LOCK_FILE


def run_dir(store: Path) -> Path:
    """Volatile daemon state: the drain deadline and, by default, the control socket."""
    return store / RUN_DIR


def daemon_lock_file(store: Path) -> Path:
    return run_dir(store) / DAEMON_LOCK_FILE


def drain_deadline_file(store: Path) -> Path:
    return store / RUN_DIR / DRAIN_DEADLINE_FILE


def default_socket(store: Path) -> Path:
    return store / RUN_DIR / DEFAULT_SOCKET_FILE


def ops_dir(store: Path) -> Path:
    """The consumer's operation journal."""
    return store / OPS_DIR


def op_entry(store: Path, op_id: str, verb: str) -> Path:
    """The journal entry of one completed operation; ``op_id`` is not validated here."""
    return store / OPS_DIR / f"{op_id}.{verb}.json"


def temp_file(path: Path, pid: int) -> Path:
    """Where process ``pid`` writes ``path`` before renaming it over the old one.

    Per pid, so two processes never write one temp file; one process must not write the
    same path twice at once.
    """
    return path.with_name(f".{path.name}.{pid}.tmp")
