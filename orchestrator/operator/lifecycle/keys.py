"""The idempotency key of every operation the operator begins for a task
(``operation_key``): a re-run pass, or another replica, finds the operation in the
ledger instead of beginning a second one."""

from __future__ import annotations

from enum import StrEnum


class Purpose(StrEnum):
    """Why the operator begins a ledger operation for a task.

    With the task's uid it makes the operation's idempotency key (``operation_key``), so
    an operator restarted mid-operation finds the operation it began instead of
    beginning a second one. The values are stored in the ledger's keys: renaming one
    makes a restarted operator repeat an operation already under way.
    """

    DELETE = "delete"
    """The drain finalizer's drain: once per task."""
    FORCE = "force"
    """The forced checkpoint past ``drainTimeout``: once per task."""
    RESTORE = "restore"
    """The first start from ``spec.resumeFrom``: once per task."""
    PAUSE = "pause"
    """A pause's drain: one per pause, numbered by ``status.pauses``."""
    RESUME = "resume"
    """A resume from a pause's checkpoint: one per checkpoint ref."""
    RECOVER = "recover"
    """Resuming agents a disruption stopped: one per recovery, numbered by
    ``status.recoveries``."""
    SCALE = "scale"
    """Following a changed ``spec.task.agents``: one per change, numbered by
    ``status.scales``."""
    ROLL = "roll"
    """A roll's drain (a spec edit that changes the pod): one per roll, numbered by
    ``status.rolls``."""
    COMPLETE = "complete"
    """Recording the checkpoint of a task whose agents all finished their work: one per
    attempt, numbered by ``status.completions`` (a failed attempt is tried again under
    the next number)."""


_REPEATING = frozenset(
    {Purpose.PAUSE, Purpose.ROLL, Purpose.RESUME, Purpose.RECOVER, Purpose.SCALE, Purpose.COMPLETE}
)


def operation_key(uid: str, purpose: Purpose, which: int | str | None = None) -> str:
    """The idempotency key of the operation begun for ``purpose``: ``<uid>:<purpose>``, and
    ``:<which>`` for a purpose that repeats (which pause, which checkpoint, which
    recovery). The uid comes first, so a task re-created under a deleted task's name
    never finds the old task's operations."""
    if (which is None) == (purpose in _REPEATING):
        needs = "needs" if purpose in _REPEATING else "takes no"
        raise ValueError(f"an operation key for {purpose.value!r} {needs} a discriminator")
    return f"{uid}:{purpose.value}" if which is None else f"{uid}:{purpose.value}:{which}"
