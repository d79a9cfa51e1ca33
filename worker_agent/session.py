"""The resumable conversation file, ``session.json``, shared by the daemon and workers.

The worker writes it after every completed turn; the daemon verifies it when it drains
(parses, checks the shape, hashes the bytes) and before it resumes an agent. Standard
library only: the reference worker imports this module and must start fast.

Invariant: a ``session.json`` on disk is always a whole, previously written version,
because every write goes to a temporary file that is fsynced and then renamed over the
old one, and the directory is fsynced so the rename itself survives a crash.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker_agent.layout import SESSION_FILE, TRANSCRIPT_FILE, temp_file

__all__ = ["SESSION_FILE", "TRANSCRIPT_FILE"]  # re-exported: older imports name them here

SESSION_VERSION = 1
MAX_SESSION_BYTES = 256 * 1024 * 1024
"""The largest session.json the daemon and workers read: a conversation is text, and a
file past this is not one a worker wrote (it would also stall a drain reading it)."""
DRAIN_DEADLINE_ENV = "CALIBAN_DRAIN_DEADLINE_FILE"
"""Names a file the daemon writes once, just before a drain's SIGTERMs: the deadline in
Unix seconds after which it SIGKILLs. A worker reads it to decide whether its in-flight
turn fits."""


class SessionError(Exception):
    """A session.json that cannot be resumed; the message says what is wrong with it."""


@dataclass(frozen=True)
class Session:
    agent_id: str
    turns: int
    messages: list[dict[str, Any]]
    extra: dict[str, Any]
    sha256: str

    def to_document(self) -> dict[str, Any]:
        return {
            **self.extra,
            "version": SESSION_VERSION,
            "agent_id": self.agent_id,
            "turns": self.turns,
            "messages": self.messages,
        }


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_filesystem(path: Path) -> None:
    """Flush the filesystem holding ``path`` (``syncfs``), not every disk of the machine;
    ``os.sync`` where ``syncfs`` is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syncfs = libc.syncfs
    except (OSError, AttributeError):
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so a reader sees the old or the new bytes, never a mix.

    ``durable`` fsyncs the file and its directory; without it the write is still atomic
    but may be lost (as a whole) by a machine crash, which suits volatile state.
    """
    tmp = temp_file(path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        # A failed write (ENOSPC, EIO) leaves the old file whole and no partial temp file.
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def decode_session(raw: bytes, *, source: str) -> Session:
    """Parse and check a session document; raise ``SessionError`` naming the fault."""
    digest = hashlib.sha256(raw).hexdigest()
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SessionError(f"{source} is not valid JSON ({exc}); it may be truncated") from None
    if not isinstance(doc, dict):
        raise SessionError(f"{source} must hold a JSON object, not {type(doc).__name__}")
    version = doc.get("version")
    if version != SESSION_VERSION:
        raise SessionError(f"{source} has version {version!r}; this build reads version 1")
    agent_id = doc.get("agent_id")
    if not isinstance(agent_id, str) or not agent_id:
        raise SessionError(f"{source} has no string 'agent_id'")
    turns = doc.get("turns")
    if not isinstance(turns, int) or isinstance(turns, bool) or turns < 0:
        raise SessionError(f"{source} has no non-negative integer 'turns' (got {turns!r})")
    messages = doc.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise SessionError(f"{source} has no 'messages' list of objects")
    extra = {k: v for k, v in doc.items() if k not in {"version", "agent_id", "turns", "messages"}}
    return Session(agent_id, turns, messages, extra, digest)


def load_session(session_dir: Path) -> Session:
    path = session_dir / SESSION_FILE
    try:
        size = path.stat().st_size
        if size > MAX_SESSION_BYTES:
            raise SessionError(f"{path} has {size} bytes; at most {MAX_SESSION_BYTES} are read")
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SessionError(f"{path} does not exist: the agent never saved a turn") from None
    except OSError as exc:
        raise SessionError(f"{path} cannot be read: {exc.strerror}") from None
    return decode_session(raw, source=str(path))


def save_session(session_dir: Path, session: Session) -> str:
    """Write ``session.json`` durably; return the sha256 of the bytes written."""
    raw = json.dumps(session.to_document(), separators=(",", ":")).encode()
    atomic_write(session_dir / SESSION_FILE, raw)
    return hashlib.sha256(raw).hexdigest()


def count_completed_turns(session_dir: Path) -> int:
    """How many ``turn_complete`` events the transcript holds (a torn last line is skipped)."""
    path = session_dir / TRANSCRIPT_FILE
    count = 0
    try:
        with path.open("rb") as fh:
            for line in fh:
                if b'"turn_complete"' not in line:
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and event.get("type") == "turn_complete":
                    count += 1
    except FileNotFoundError:
        return 0
    return count


MAX_UNANNOUNCED_TURNS = 1
"""A worker saves ``session.json`` and only then announces the turn in the transcript, so
a crash between the two can leave exactly one completed turn unannounced, never more."""


def check_transcript(session_dir: Path, session: Session) -> int:
    """How many turns the transcript has yet to announce (0 or 1), or ``SessionError``.

    A session that claims more completed turns than that over its transcript was not
    written by the worker contract (edited, or mixed up with another agent's): resuming
    it would invent turns that never happened.
    """
    announced = count_completed_turns(session_dir)
    missing = session.turns - announced
    if not 0 <= missing <= MAX_UNANNOUNCED_TURNS:
        raise SessionError(
            f"{session_dir / SESSION_FILE} records {session.turns} completed turns but "
            f"{session_dir / TRANSCRIPT_FILE} announces {announced}; a crash can leave at "
            f"most {MAX_UNANNOUNCED_TURNS} unannounced, so this session is not resumable as is"
        )
    return missing
