"""The resumable conversation file, ``session.json``, shared by the daemon and workers.

The worker writes it after every completed turn; the daemon verifies it when it drains
(parses, checks the shape, hashes the bytes) and before it resumes an agent. Standard
library only: the reference worker imports this module and must start fast.

The document is upstream caliban's ``PersistedSession`` (caliban-sessions) as serde writes
it: ``name``, ``created_at``/``updated_at`` (RFC 3339), ``provider``, ``model``,
``messages`` (``{role, content: [blocks]}``), ``total_usage``, ``todos``, ``plan_mode``,
plus one key of ours, ``caliban_drain: {version, agent_id, turns}``, which upstream's
readers ignore. The sha256 the daemon records is over the file's bytes, that key included.

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
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from worker_agent import transcript
from worker_agent.layout import SESSION_FILE, TRANSCRIPT_FILE, temp_file

__all__ = ["SESSION_FILE", "TRANSCRIPT_FILE"]  # re-exported: older imports name them here

SESSION_VERSION = 2
"""The version of the ``caliban_drain`` key this build writes. Version 1 was the whole
document of earlier builds (``{version, agent_id, turns, messages}``); it is still read."""
LEGACY_SESSION_VERSION = 1
DRAIN_KEY = "caliban_drain"
"""The one top-level key of ours in session.json: upstream's ``PersistedSession`` does not
deny unknown fields, so its readers ignore it."""
MAX_SESSION_BYTES = 256 * 1024 * 1024
"""The largest session.json the daemon and workers read: a conversation is text, and a
file past this is not one a worker wrote (it would also stall a drain reading it)."""
DRAIN_DEADLINE_ENV = "CALIBAN_DRAIN_DEADLINE_FILE"
"""Names a file the daemon writes once, just before a drain's SIGTERMs: the deadline in
Unix seconds after which it SIGKILLs. A worker reads it to decide whether its in-flight
turn fits."""

ROLES = frozenset({"user", "assistant", "system"})
BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "thinking"})
TODO_STATUSES = frozenset({"pending", "in_progress", "completed", "cancelled"})
U32_MAX = 2**32 - 1
_RFC3339 = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})$"
)
ORIGIN_OURS = "caliban-drain"
ORIGIN_UPSTREAM = "upstream"
ORIGIN_LEGACY = "legacy-v1"


class SessionError(Exception):
    """A session.json that cannot be resumed; the message says what is wrong with it."""


def text_message(role: str, text: str) -> dict[str, Any]:
    """A message of one text block, as upstream's ``Message`` serializes it."""
    return {"role": role, "content": [{"type": "text", "text": text}]}


def message_text(message: dict[str, Any]) -> str:
    """The text blocks of a message joined by newlines (other blocks have no text)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "\n".join(
        b["text"] for b in content if isinstance(b, dict) and isinstance(b.get("text"), str)
    )


def as_message(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` in upstream's shape: a string ``content`` becomes one text block, and
    only ``role`` and ``content`` are kept (earlier builds also kept a ``turn``)."""
    content = message.get("content")
    if isinstance(content, list):
        return {"role": message.get("role"), "content": content}
    return text_message(str(message.get("role")), "" if content is None else str(content))


def utc_timestamp(seconds: float | None = None) -> str:
    """RFC 3339 in UTC with a ``Z``, as chrono writes a ``DateTime<Utc>``."""
    moment = datetime.fromtimestamp(time.time() if seconds is None else seconds, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Session:
    """A conversation: ``messages`` are upstream ``Message`` objects, ``extra`` every other
    top-level key of the document as read (``name``, ``created_at``, ``provider``, ``model``,
    ``total_usage``, ``todos``, ``plan_mode`` and any key a newer writer added), kept so a
    rewrite loses nothing. ``agent_id`` is None for a session upstream wrote (it names no
    agent of ours); ``origin`` says which writer the document came from."""

    agent_id: str | None
    turns: int
    messages: list[dict[str, Any]]
    extra: dict[str, Any]
    sha256: str
    origin: str = ORIGIN_OURS

    def to_document(self) -> dict[str, Any]:
        """The document a worker writes: a valid upstream ``PersistedSession`` plus our
        ``caliban_drain`` key. Missing upstream fields get upstream's defaults, missing
        timestamps the current time (the worker sets ``updated_at`` at every save, so the
        same session saved twice is the same bytes)."""
        stamp = utc_timestamp()
        extra = {k: v for k, v in self.extra.items() if k != DRAIN_KEY}
        created = extra.pop("created_at", stamp)
        return {
            "name": extra.pop("name", self.agent_id or ""),
            "created_at": created,
            "updated_at": extra.pop("updated_at", stamp),
            "provider": extra.pop("provider", ""),
            "model": extra.pop("model", ""),
            "messages": [as_message(m) for m in self.messages],
            "total_usage": extra.pop("total_usage", {"input_tokens": 0, "output_tokens": 0}),
            "todos": extra.pop("todos", []),
            "plan_mode": extra.pop("plan_mode", False),
            **extra,
            DRAIN_KEY: {
                "version": SESSION_VERSION,
                "agent_id": self.agent_id,
                "turns": self.turns,
            },
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


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= U32_MAX


def _check_messages(messages: object, source: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise SessionError(f"{source} has no 'messages' list")
    for n, message in enumerate(messages):
        if not isinstance(message, dict):
            raise SessionError(f"{source}: message {n} is not an object")
        if message.get("role") not in ROLES:
            raise SessionError(
                f"{source}: message {n} has role {message.get('role')!r}, "
                "not one of assistant, system, user"
            )
        content = message.get("content")
        if not isinstance(content, list):
            raise SessionError(f"{source}: message {n} has no 'content' list of blocks")
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in BLOCK_TYPES:
                raise SessionError(
                    f"{source}: message {n} has a content block of type {kind!r}, "
                    f"not one of {', '.join(sorted(BLOCK_TYPES))}"
                )
            if kind == "text" and not isinstance(block.get("text"), str):
                raise SessionError(f"{source}: message {n} has a text block without 'text'")
    return messages


def _check_upstream(doc: dict[str, Any], source: str) -> None:
    """The fields upstream's ``PersistedSession`` requires, with the types it reads."""
    for key in ("name", "provider", "model"):
        if not isinstance(doc.get(key), str):
            raise SessionError(f"{source} has no string {key!r}")
    for key in ("created_at", "updated_at"):
        value = doc.get(key)
        if not isinstance(value, str) or not _RFC3339.match(value):
            raise SessionError(f"{source} has no RFC 3339 timestamp {key!r} (got {value!r})")
    usage = doc.get("total_usage")
    if not (
        isinstance(usage, dict)
        and _is_count(usage.get("input_tokens"))
        and _is_count(usage.get("output_tokens"))
        and all(
            usage.get(k) is None or _is_count(usage[k])
            for k in ("cache_creation_input_tokens", "cache_read_input_tokens")
        )
    ):
        raise SessionError(f"{source} has no 'total_usage' with token counts")
    todos = doc.get("todos", [])
    if not isinstance(todos, list) or not all(
        isinstance(t, dict)
        and isinstance(t.get("id"), str)
        and isinstance(t.get("content"), str)
        and t.get("status") in TODO_STATUSES
        for t in todos
    ):
        raise SessionError(f"{source} has a 'todos' value that is not a list of todos")
    if not isinstance(doc.get("plan_mode", False), bool):
        raise SessionError(f"{source} has a 'plan_mode' that is not true or false")


def _decode_legacy(doc: dict[str, Any], digest: str, source: str) -> Session:
    """A version-1 document of an earlier build: its messages were ``{role, content: str,
    turn}``; they are read into upstream's shape, so the next save writes version 2."""
    agent_id = doc.get("agent_id")
    if not isinstance(agent_id, str) or not agent_id:
        raise SessionError(f"{source} has no string 'agent_id'")
    turns = doc.get("turns")
    if not isinstance(turns, int) or not _is_count(turns):
        raise SessionError(f"{source} has no non-negative integer 'turns' (got {turns!r})")
    messages = doc.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise SessionError(f"{source} has no 'messages' list of version-1 messages")
    extra = {k: v for k, v in doc.items() if k not in {"version", "agent_id", "turns", "messages"}}
    converted = [text_message(m["role"], m["content"]) for m in messages]
    return Session(agent_id, turns, converted, extra, digest, ORIGIN_LEGACY)


def decode_session(raw: bytes, *, source: str, agent_id: str | None = None) -> Session:
    """Parse and check a session document; raise ``SessionError`` naming the fault.

    Three writers are understood: this build's (an upstream ``PersistedSession`` with a
    ``caliban_drain`` key), upstream's own types (no ``caliban_drain``: the turns are its
    assistant messages and the agent is ``agent_id``, the caller's context, or None) and
    earlier builds (``version`` 1). Anything else is refused in one line.
    """
    digest = hashlib.sha256(raw).hexdigest()
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SessionError(f"{source} is not valid JSON ({exc}); it may be truncated") from None
    except RecursionError:
        raise SessionError(f"{source} nests too deeply to be a session") from None
    if not isinstance(doc, dict):
        raise SessionError(f"{source} must hold a JSON object, not {type(doc).__name__}")
    ours = doc.get(DRAIN_KEY)
    if ours is None and "name" not in doc and "version" not in doc:
        raise SessionError(
            f"{source} is not a session: it has neither 'name' (a PersistedSession) nor "
            "'version' (an earlier build's)"
        )
    if ours is None and "version" in doc and "name" not in doc:
        version = doc.get("version")
        if version != LEGACY_SESSION_VERSION:
            raise SessionError(
                f"{source} has version {version!r}; this build reads version "
                f"{SESSION_VERSION} (and {LEGACY_SESSION_VERSION}) and upstream sessions"
            )
        return _decode_legacy(doc, digest, source)
    _check_upstream(doc, source)
    messages = _check_messages(doc.get("messages"), source)
    extra = {k: v for k, v in doc.items() if k not in ("messages", DRAIN_KEY)}
    if ours is None:
        replies = sum(1 for m in messages if m["role"] == "assistant")
        return Session(agent_id, replies, messages, extra, digest, ORIGIN_UPSTREAM)
    if not isinstance(ours, dict):
        raise SessionError(f"{source} has a {DRAIN_KEY!r} that is not an object")
    version = ours.get("version")
    if version != SESSION_VERSION:
        raise SessionError(
            f"{source} has {DRAIN_KEY} version {version!r}; this build reads version "
            f"{SESSION_VERSION} (and {LEGACY_SESSION_VERSION}) and upstream sessions"
        )
    owner = ours.get("agent_id")
    if not isinstance(owner, str) or not owner:
        raise SessionError(f"{source} has no string {DRAIN_KEY}.agent_id")
    turns = ours.get("turns")
    if not isinstance(turns, int) or not _is_count(turns):
        raise SessionError(
            f"{source} has no non-negative integer {DRAIN_KEY}.turns (got {turns!r})"
        )
    return Session(owner, turns, messages, extra, digest, ORIGIN_OURS)


def load_session(session_dir: Path, *, agent_id: str | None = None) -> Session:
    """``session.json`` of ``session_dir``; ``agent_id`` is the agent a session upstream
    wrote is taken to be (it names none itself)."""
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
    return decode_session(raw, source=str(path), agent_id=agent_id)


def save_session(session_dir: Path, session: Session) -> str:
    """Write ``session.json`` durably; return the sha256 of the bytes written."""
    raw = json.dumps(session.to_document(), separators=(",", ":")).encode()
    atomic_write(session_dir / SESSION_FILE, raw)
    return hashlib.sha256(raw).hexdigest()


def count_completed_turns(session_dir: Path) -> int:
    """How many turns the transcript announces: its ``TurnEnd`` records (and an earlier
    build's ``turn_complete`` lines); a torn last line is skipped."""
    return transcript.count_turn_ends(session_dir / TRANSCRIPT_FILE)


MAX_UNANNOUNCED_TURNS = 1
"""A worker saves ``session.json`` and only then announces the turn in the transcript
(``TurnEnd``), so a crash between the two can leave exactly one completed turn
unannounced, never more."""


def check_transcript(session_dir: Path, session: Session) -> int:
    """How many turns the transcript has yet to announce, or ``SessionError``.

    For a session of ours that is 0 or 1. A session that claims more completed turns than
    that over its transcript was not written by the worker contract (edited, or mixed up
    with another agent's): resuming it would invent turns that never happened. A session
    upstream's types wrote made no such promise (upstream's worker keeps no session.json
    beside its transcript): any number of its turns may be unannounced, and the worker
    announces them when it adopts the session. A transcript announcing more turns than
    any session holds is refused either way.
    """
    announced = count_completed_turns(session_dir)
    missing = session.turns - announced
    limit = session.turns if session.origin == ORIGIN_UPSTREAM else MAX_UNANNOUNCED_TURNS
    if not 0 <= missing <= limit:
        raise SessionError(
            f"{session_dir / SESSION_FILE} records {session.turns} completed turns but "
            f"{session_dir / TRANSCRIPT_FILE} announces {announced}; a crash can leave at "
            f"most {MAX_UNANNOUNCED_TURNS} unannounced, so this session is not resumable as is"
        )
    return missing
