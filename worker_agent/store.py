"""The daemon's on-disk layout: one directory per agent on the workspace volume.

``<store>/agents/<id>/manifest.json`` is the ``AgentRecord`` (written atomically),
``session.json`` the worker's resumable conversation, ``stdout.ndjson`` the worker's
append-only event transcript, ``stderr.log`` its diagnostics and ``worker.lock`` the
lock a worker holds on its directory for as long as it runs. The names are spelled in
``layout``; this module reads and writes the files.

This module knows paths and files; ``registry`` knows which agents are live. It also
owns the two rules that keep a store safe: one daemon per store (``<store>/run/daemon.lock``,
an exclusive ``flock`` held for the daemon's lifetime, taken before anything in the store
or its socket is touched), and a session dir is accepted by ``resume`` only if it
resolves, after symlinks, to an agent directory inside this store.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import shutil
from pathlib import Path

from pydantic import ValidationError

from worker_agent.layout import (
    AGENT_SOCKET_FILE,
    agents_dir,
    daemon_lock_file,
    lock_file,
    manifest_file,
)
from worker_agent.proto import AgentRecord, ErrorKind, ProtocolError, UnixEndpoint
from worker_agent.session import SessionError, atomic_write, check_transcript, load_session

log = logging.getLogger(__name__)

AGENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class StoreInUse(Exception):
    """Another daemon holds this store; the message names it and what to do."""


class Store:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.agents_dir = agents_dir(self.root)
        self._lock_fd: int | None = None

    def lock(self) -> None:
        """Take the store for this process, or raise ``StoreInUse`` naming the holder.

        Two daemons on one store would each believe they own its agents: the second
        would mark the first's running agents ``crashed`` and answer drains for workers
        it does not control. The lock is released by the kernel when the process dies,
        however it dies, so a SIGKILLed daemon never leaves a stale lock behind.
        """
        path = daemon_lock_file(self.root)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreInUse(
                f"store {self.root} is in use by another daemon (pid {holder}); stop it "
                "first, or give this daemon its own --store"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def prepare(self) -> None:
        self.agents_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def new_agent_id(self) -> str:
        while True:
            agent_id = f"agent-{secrets.token_hex(6)}"
            if not (self.agents_dir / agent_id).exists():
                return agent_id

    def agent_dir(self, agent_id: str) -> Path:
        if not AGENT_ID.match(agent_id):
            raise ProtocolError(ErrorKind.BAD_REQUEST, f"{agent_id!r} is not a valid agent id")
        return self.agents_dir / agent_id

    def relative(self, path: Path) -> str:
        """A session dir as the ledger stores it: relative to the store (the PVC root)."""
        return str(path.relative_to(self.root))

    def save_manifest(self, record: AgentRecord, *, durable: bool = True) -> None:
        directory = self.agents_dir / record.id
        atomic_write(
            manifest_file(directory), record.model_dump_json(indent=2).encode(), durable=durable
        )

    def load_manifests(self) -> list[AgentRecord]:
        """Every readable manifest. A broken one is logged and left on disk untouched."""
        records: list[AgentRecord] = []
        if not self.agents_dir.is_dir():
            return records
        for entry in sorted(self.agents_dir.iterdir()):
            manifest = manifest_file(entry)
            try:
                # A symlinked agent dir could point anywhere; only real directories are ours.
                if entry.is_symlink() or not entry.is_dir() or not AGENT_ID.match(entry.name):
                    continue
                if manifest.is_symlink() or not manifest.is_file():
                    continue
                record = AgentRecord.model_validate_json(manifest.read_bytes())
            except (ValidationError, OSError) as exc:
                # One unreadable directory must not keep the daemon from serving the rest.
                log.warning("manifest_unreadable path=%s error=%s", manifest, exc)
                continue
            if record.id != entry.name:
                log.warning("manifest_misplaced path=%s id=%s", manifest, record.id)
                continue
            # The manifest is writable by the worker that runs in this directory, so its
            # session_dir is never trusted: the directory is where the manifest lives.
            # Nor are the paths derived from it (a restored store may be mounted elsewhere).
            where = {
                "session_dir": str(entry),
                "endpoint": UnixEndpoint(path=str(entry / AGENT_SOCKET_FILE)),
                "working_dir": record.spec.cwd or str(entry),
            }
            records.append(record.model_copy(update=where))
        return records

    def remove_agent_dir(self, agent_id: str) -> None:
        """Delete an agent's directory, refusing anything that is not a real dir of ours."""
        directory = self.agent_dir(agent_id)
        if directory.is_symlink() or directory.resolve().parent != self.agents_dir:
            raise ProtocolError(
                ErrorKind.INVALID_STATE, f"{directory} is not a directory of this store", agent_id
            )
        failures: list[str] = []

        def note(_func: object, path: str, exc_info: object) -> None:
            failures.append(f"{path}: {exc_info[1] if isinstance(exc_info, tuple) else exc_info}")

        shutil.rmtree(directory, onerror=note)
        if directory.exists() or failures:
            raise ProtocolError(
                ErrorKind.INTERNAL,
                f"could not remove {directory}: {failures[0] if failures else 'still present'}",
                agent_id,
            )

    def resolve_session_dir(self, raw: str) -> Path:
        """The agent directory ``raw`` names, or ``ProtocolError`` if it is not one of ours.

        ``raw`` may be absolute or relative to the store root. Symlinks are resolved
        before the check, so a link that points out of the store is refused too.
        """
        if "\x00" in raw:
            raise ProtocolError(ErrorKind.BAD_REQUEST, f"session_dir {raw!r} contains a NUL byte")
        candidate = Path(raw) if os.path.isabs(raw) else self.root / raw
        resolved = candidate.resolve()
        if not resolved.is_relative_to(self.root):
            raise ProtocolError(
                ErrorKind.BAD_REQUEST,
                f"session_dir {raw!r} resolves to {resolved}, outside the store {self.root}",
            )
        if resolved.parent != self.agents_dir or not AGENT_ID.match(resolved.name):
            raise ProtocolError(
                ErrorKind.BAD_REQUEST,
                f"session_dir {raw!r} is not an agent directory {self.agents_dir}/<id>",
            )
        if not resolved.is_dir():
            raise ProtocolError(
                ErrorKind.NOT_FOUND, f"session_dir {raw!r} does not exist", resolved.name
            )
        return resolved

    def check_expected(self, session_dir: Path, turns: int | None, sha256: str | None) -> None:
        """Refuse to resume a checkpoint whose session is no longer what it recorded.

        Without a snapshot per checkpoint, a workspace holds only its newest state: an
        older checkpoint of it cannot be restored, and resuming the newer state in its
        name would silently start from turns the checkpoint never had.
        """
        if turns is None and sha256 is None:
            return
        try:
            session = load_session(session_dir)
        except SessionError as exc:
            raise ProtocolError(
                ErrorKind.INVALID_STATE,
                f"cannot resume {session_dir.name}: {exc}",
                session_dir.name,
            ) from None
        if (turns is not None and session.turns != turns) or (
            sha256 is not None and session.sha256 != sha256
        ):
            raise ProtocolError(
                ErrorKind.INVALID_STATE,
                f"cannot resume {session_dir.name} from this checkpoint: it recorded turn "
                f"{turns} (session sha256 {(sha256 or '-')[:12]}), the workspace now holds "
                f"turn {session.turns} ({session.sha256[:12]}); it has moved on since, and "
                "only a workspace's newest checkpoint can be resumed from it",
                session_dir.name,
            )

    def check_resumable(self, session_dir: Path) -> int:
        """The number of completed turns to resume from, or a clear refusal."""
        try:
            # A session upstream's types wrote names no agent: it is this directory's.
            session = load_session(session_dir, agent_id=session_dir.name)
            check_transcript(session_dir, session)
        except SessionError as exc:
            raise ProtocolError(
                ErrorKind.INVALID_STATE,
                f"cannot resume {session_dir.name}: {exc}",
                session_dir.name,
            ) from None
        if session.agent_id != session_dir.name:
            raise ProtocolError(
                ErrorKind.INVALID_STATE,
                f"cannot resume {session_dir.name}: session.json belongs to agent "
                f"{session.agent_id!r}",
            )
        return session.turns


def lock_is_held(session_dir: Path) -> bool:
    """True while some worker process holds the directory's lock."""
    path = lock_file(session_dir)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
