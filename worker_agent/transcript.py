"""``stdout.ndjson``: the worker's append-only transcript, upstream caliban's ``TurnEvent``.

Every line is one ``TurnEvent`` (caliban-agent-core) as serde writes it: internally tagged
by ``"type"``, compact, ``type`` first. The worker writes, per turn, ``TurnStart``, one
``AssistantTextDelta`` with the reply's text, then (after ``session.json`` is saved)
``TurnEnd``; and one ``RunEnd`` when it exits. Whatever else we need rides in one extra
key, ``caliban_drain``, which upstream's reader ignores (its ``TurnEvent`` variants do not
deny unknown fields):

- every record: ``ts`` (Unix seconds, when it was written);
- ``TurnEnd``: ``turn`` (1-based, over the whole conversation) and ``session_sha256`` of
  the session.json that holds the turn, or ``recovered: true`` when a resumed worker
  announces a turn saved but not announced before a crash;
- a resumed worker's first record after any recovered ``TurnEnd``: an empty
  ``AssistantTextDelta`` of the turn it continues at (upstream renders it as nothing)
  with ``resumed_from``, that turn (and ``adopted: true`` when upstream wrote the session);
- ``RunEnd``: ``turns`` (the conversation's, not only this run's), ``stop`` (``finished``,
  ``drain``, ``failed``) and ``abandoned_turn`` when a drain cut a turn short.

``turn_index`` is zero-based over the whole conversation (turn ``k`` is index ``k - 1``),
so it stays unique across resumes; upstream counts it within one run. Turns are counted
from ``TurnEnd`` records. An earlier build wrote ``{"type": "turn_complete", "turn": k}``
lines instead; those still count, so a session drained by it resumes under this one.

Standard library only: the worker imports it and must start fast.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

KEY = "caliban_drain"
TURN_START = "TurnStart"
TEXT_DELTA = "AssistantTextDelta"
TURN_END = "TurnEnd"
RUN_END = "RunEnd"
LEGACY_TURN_COMPLETE = "turn_complete"
END_OF_TURN = "EndOfTurn"
CANCELLED = "Cancelled"
ZERO_USAGE: dict[str, int] = {"input_tokens": 0, "output_tokens": 0}


def duration(seconds: float) -> dict[str, int]:
    """A ``std::time::Duration`` as serde writes it."""
    nanos = max(0, round(seconds * 1e9))
    return {"secs": nanos // 1_000_000_000, "nanos": nanos % 1_000_000_000}


def provider_error(message: str) -> dict[str, str]:
    """``StopCondition::ProviderError(message)`` (externally tagged, as serde writes it)."""
    return {"ProviderError": message}


def turn_start(turn: int, message_id: str, model: str) -> dict[str, Any]:
    return {"type": TURN_START, "turn_index": turn - 1, "message_id": message_id, "model": model}


def text_delta(turn: int, text: str) -> dict[str, Any]:
    return {"type": TEXT_DELTA, "turn_index": turn - 1, "content_block_index": 0, "text": text}


def turn_end(
    turn: int,
    assistant_message: dict[str, Any],
    *,
    ttft: float | None = None,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    return {
        "type": TURN_END,
        "turn_index": turn - 1,
        "assistant_message": assistant_message,
        "tool_results": [],
        "stop_reason": "end_turn",
        "usage": dict(usage or ZERO_USAGE),
        "ttft": None if ttft is None else duration(ttft),
        "tbt": None,
    }


def run_end(
    final_messages: list[dict[str, Any]],
    total_usage: dict[str, Any],
    turn_count: int,
    stopped_for: str | dict[str, Any],
) -> dict[str, Any]:
    return {
        "type": RUN_END,
        "final_messages": final_messages,
        "total_usage": total_usage,
        "turn_count": turn_count,
        "stopped_for": stopped_for,
        "turns_without_edit": 0,
        "no_edit_nudge_emitted": False,
    }


def encode(event: dict[str, Any], **ours: Any) -> bytes:
    """One line: ``event`` with ``caliban_drain`` (``ts`` and ``ours``) added, compact."""
    return (
        json.dumps(
            {**event, KEY: {"ts": round(time.time(), 3), **ours}},
            separators=(",", ":"),
        ).encode()
        + b"\n"
    )


def write(fd: int, line: bytes) -> None:
    """Append ``line`` to ``fd`` (an ``O_APPEND`` stdout: one write, lines never mix)."""
    view = memoryview(line)
    while view:
        view = view[os.write(fd, view) :]


def ours(event: dict[str, Any]) -> dict[str, Any]:
    """The ``caliban_drain`` part of a record (empty for one upstream wrote)."""
    extra = event.get(KEY)
    return extra if isinstance(extra, dict) else {}


def stamp(event: dict[str, Any]) -> float | None:
    """When the record was written (``caliban_drain.ts``, or an earlier build's ``ts``)."""
    value = ours(event).get("ts", event.get("ts"))
    return float(value) if isinstance(value, int | float) else None


def completed_turn(event: dict[str, Any]) -> int | None:
    """The 1-based turn a record announces complete, or None if it announces none."""
    kind = event.get("type")
    if kind == TURN_END:
        index = event.get("turn_index")
        return index + 1 if isinstance(index, int) else None
    if kind == LEGACY_TURN_COMPLETE:
        turn = event.get("turn")
        return turn if isinstance(turn, int) else None
    return None


def resumed_from(event: dict[str, Any]) -> int | None:
    """The turn a resumed worker continued at, on the marker it wrote when it started."""
    if event.get("type") == "resumed":  # an earlier build's own record
        value = event.get("from_turn")
    else:
        value = ours(event).get("resumed_from")
    return value if isinstance(value, int) else None


def events(path: Path) -> Iterator[dict[str, Any]]:
    """Every whole record of the transcript at ``path`` (torn or foreign lines skipped)."""
    try:
        with path.open("rb") as fh:
            for line in fh:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    yield event
    except FileNotFoundError:
        return


def count_turn_ends(path: Path) -> int:
    """How many turns the transcript at ``path`` announces complete."""
    count = 0
    try:
        with path.open("rb") as fh:
            for line in fh:
                if b'"TurnEnd"' not in line and b'"turn_complete"' not in line:
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and completed_turn(event) is not None:
                    count += 1
    except FileNotFoundError:
        return 0
    return count
