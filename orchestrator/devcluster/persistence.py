"""The embedded API's objects on disk, so ``drainctl dev up`` keeps its cluster across a
restart as a real cluster keeps etcd.

:class:`~orchestrator.devcluster.store.ClusterState` hands out a
:class:`~orchestrator.devcluster.store.Snapshot` and restores one; this module owns the
file: :func:`encode` and :func:`decode` (a JSON document, its format pinned by
:data:`FORMAT`), :func:`write_atomically` (temp file, fsync, rename, fsync of the
directory, so a crash leaves the old file or the new one, never half of one), and
:class:`StateSaver`, the debounced writer :class:`~orchestrator.devcluster.apiserver.
EmbeddedApiServer` runs on its event loop.

What must stay true: the snapshot is encoded on the event loop in one go (a request
never sees half a save, and the objects cannot change under the encoder); only the
write runs in a thread; a save happens at most once per ``interval`` however many
changes come, so a thousand objects cost one encoding per interval and not one per
write, and once encoding takes longer than a tenth of that, at most once per
:data:`SAVE_PACE` times the last encoding's time, so the saver never holds the API's
event loop more than a tenth of the time whatever the state's size (a fan-out of
hundreds of tasks with their events and snapshots otherwise had the loop encoding most of
the time, and every request waited behind it); the last save, on a clean stop, has
everything. A SIGKILL loses at most the changes of the last interval, and the
controllers re-converge those (they list again after the restart, as after a real
server's compaction). Standard library only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Final

from orchestrator.devcluster.resources import ResourceKey
from orchestrator.devcluster.store import ClusterState, Snapshot

log = logging.getLogger(__name__)

API_STATE_FILE: Final = "api-state.json"
"""The file in ``drainctl dev up``'s state dir that holds the embedded API's objects."""
FORMAT: Final = 1
"""The version of the file's layout; a file of another version is refused, not guessed."""
SAVE_INTERVAL_SECS: Final = 0.15
SAVE_PACE: Final = 10.0
"""A save comes at least this many times its encoding's duration after the last one."""


class StateFileError(Exception):
    """The state file cannot be read or restored; the message names the file and why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def encode(snapshot: Snapshot) -> str:
    document = {
        "format": FORMAT,
        "resourceVersion": snapshot.resource_version,
        "deletionPolicies": snapshot.deletion_policies,
        "objects": [{"resource": list(key), "object": obj} for key, obj in snapshot.objects],
    }
    return json.dumps(document, separators=(",", ":"))


def decode(path: Path, text: str) -> Snapshot:
    """The snapshot in ``text`` (read from ``path``), or :class:`StateFileError`."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise StateFileError(path, f"not valid JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, dict) else None
        raise StateFileError(path, f"not a saved API state of format {FORMAT} (format {found!r})")
    counter = document.get("resourceVersion")
    policies = document.get("deletionPolicies")
    items = document.get("objects")
    if not isinstance(counter, int) or counter < 0:
        raise StateFileError(path, f"resourceVersion is {counter!r}, not a counter")
    if not isinstance(policies, dict) or not all(isinstance(v, str) for v in policies.values()):
        raise StateFileError(path, "deletionPolicies is not a map of uid to policy")
    if not isinstance(items, list):
        raise StateFileError(path, "objects is not a list")
    objects: list[tuple[ResourceKey, dict[str, Any]]] = []
    for index, item in enumerate(items):
        resource = item.get("resource") if isinstance(item, dict) else None
        obj = item.get("object") if isinstance(item, dict) else None
        if (
            not isinstance(resource, list)
            or len(resource) != 3
            or not all(isinstance(part, str) for part in resource)
            or not isinstance(obj, dict)
            or not isinstance(obj.get("metadata"), dict)
        ):
            raise StateFileError(path, f"objects[{index}] is not a resource and an object")
        objects.append(((resource[0], resource[1], resource[2]), obj))
    return Snapshot(counter, objects, dict(policies))


def load(path: Path) -> Snapshot:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise StateFileError(path, f"cannot be read ({exc})") from None
    return decode(path, text)


def restore(state: ClusterState, path: Path) -> Snapshot:
    """Restore ``state`` from ``path``; :class:`StateFileError` if it cannot be."""
    snapshot = load(path)
    try:
        state.restore(snapshot)
    except ValueError as exc:
        raise StateFileError(path, f"cannot be restored: {exc}") from None
    return snapshot


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: the old content or the new, never a mix."""
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class StateSaver:
    """Saves ``state`` to ``path`` within ``interval`` of a change, and once more on
    :meth:`close`. One task on the API's event loop; see the module for what it keeps."""

    def __init__(
        self, state: ClusterState, path: Path, interval: float = SAVE_INTERVAL_SECS
    ) -> None:
        self.state = state
        self.path = path
        self.interval = interval
        self._saved: str | None = None  # the resourceVersion on disk
        self._encoding = 0.0  # how long the last save's encoding held the event loop
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Stop, with everything saved (the last save runs before this returns)."""
        self._closing.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                pause = max(self.interval, SAVE_PACE * self._encoding)
                await asyncio.wait_for(self._closing.wait(), pause)
            # Read before the save: a close that comes while a save writes may follow
            # changes that save did not encode, so it gets one more round.
            last = self._closing.is_set()
            try:
                await self.save_if_changed()
            except OSError as exc:  # a full disk must not stop the API; the next try may pass
                log.error("api_state_save_failed path=%s error=%s", self.path, exc)
            if last:
                return

    async def save_if_changed(self) -> None:
        version = self.state.resource_version
        if version == self._saved:
            return
        started = time.monotonic()
        text = encode(self.state.snapshot())
        encoded = time.monotonic()
        self._encoding = encoded - started
        await asyncio.to_thread(write_atomically, self.path, text)
        self._saved = version
        log.debug(
            "api_state_saved resource_version=%s bytes=%d encode_ms=%.1f write_ms=%.1f",
            version,
            len(text),
            (encoded - started) * 1000,
            (time.monotonic() - encoded) * 1000,
        )
