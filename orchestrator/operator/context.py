"""What the operator's handlers share, built once when kopf starts and kept in kopf's
``memo`` (``handlers.configure``): the settings it was started with, the ledger, the
Celery app it sends chains through, the batcher of drains, the stewards' work queues,
the ledger and snapshot followers of deletions, the snapshot follower of checkpoints
whose snapshot is cut and not ready yet, and the pod settings every Sandbox gets.

Nothing here is a module global: a handler reads it from ``memo.context``, a test builds
one of its own (``OperatorContext.build``), and two operators in one process (as the
fleet benchmark runs them) never share state.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from celery import Celery

from orchestrator.ledger import Ledger, OperationState
from orchestrator.operator import blocking, events, following, kube
from orchestrator.operator.batching import DrainBatcher
from orchestrator.operator.children import PodSettings
from orchestrator.operator.crd import Manifest
from orchestrator.operator.snapshot_follower import SnapshotFollower
from orchestrator.pipeline.app import make_app
from orchestrator.settings import Settings

DELETE_POLL_SECS = 0.005
"""How often the deletions following their drains read the ledger (one read for all)."""
SNAPSHOT_POLL_SECS = 0.005
"""How often the deletions waiting for their checkpoints' snapshots look whether they are
ready (one list of them all), stretched by ``SNAPSHOT_POLL_PER_TASK`` for each."""
SNAPSHOT_POLL_PER_TASK = 0.0005


RELEASED_KEPT = 4096
"""Deletions whose release an operator remembers, to say each ``Checkpointed`` once."""


@dataclass
class OperatorContext:
    settings: Settings
    ledger: Ledger
    app: Celery
    pod: PodSettings
    drains: DrainBatcher
    """The operator's one batcher of drains (``operator.batching``): the deletions,
    pauses and completions asked for together begin in one ledger write."""
    stewards: events.WorkQueue = field(default_factory=events.WorkQueue)
    drain_states: following.Poller[str, OperationState] = field(init=False)
    """Every deletion's drain state, followed in the ledger with one read per poll (the
    operation itself read once it has moved)."""
    snapshot_states: following.Poller[tuple[str, str], Manifest] = field(init=False)
    """Every deletion's checkpoint snapshot, followed with one list per namespace per
    poll (of the awaited checkpoints' snapshots only, by label)."""
    feed: asyncio.Task[None] | None = None
    """The ledger's event feed to the stewards (``events.feed``), while kopf runs."""
    snapshot_follower: SnapshotFollower = field(init=False)
    """Every checkpoint snapshot neither ready nor failed, followed from the ledger until
    it is (``operator.snapshot_follower``), whether or not its task still exists."""
    following: asyncio.Task[None] | None = None
    """``snapshot_follower.run``, while kopf runs (with ``--manage-sandbox`` and
    ``DRAIN_SNAPSHOTS``: the operator takes snapshots)."""

    released: OrderedDict[tuple[str, str], None] = field(default_factory=OrderedDict)
    """(task uid, checkpoint ref) of the latest ``RELEASED_KEPT`` deletions released with
    their checkpoint: kopf may run a deletion's handler once more after it succeeded
    (an event of the task's own status write comes before the finalizer is gone), and
    the ``Checkpointed`` event is said once (``first_release``)."""

    def first_release(self, uid: str, ref: str) -> bool:
        """Whether this is the first release of task ``uid`` with checkpoint ``ref`` that
        this operator has seen (of the latest ``RELEASED_KEPT``)."""
        if (uid, ref) in self.released:
            return False
        self.released[(uid, ref)] = None
        while len(self.released) > RELEASED_KEPT:
            self.released.popitem(last=False)
        return True

    def __post_init__(self) -> None:
        self.drain_states = following.Poller("drains", DELETE_POLL_SECS, self._read_drains)
        self.snapshot_states = following.Poller(
            "snapshots", SNAPSHOT_POLL_SECS, _read_snapshots, SNAPSHOT_POLL_PER_TASK
        )
        self.snapshot_follower = SnapshotFollower(self.ledger, self.settings, self.stewards)

    @classmethod
    def build(cls, settings: Settings) -> OperatorContext:
        """Everything from ``settings`` alone: the ledger at ``database_url``, a Celery
        app of its broker, the pod settings of ``DRAIN_DAEMON_*`` and the log format."""
        ledger = Ledger.from_url(settings.database_url)
        app = make_app(settings)
        drains = DrainBatcher(app, lambda: ledger, settings)
        return cls(settings, ledger, app, PodSettings.of(settings), drains)

    async def _read_drains(self, op_ids: Collection[str]) -> Mapping[str, OperationState]:
        return await blocking.in_thread(self.ledger.operation_states, op_ids)


async def _read_snapshots(keys: Collection[tuple[str, str]]) -> Mapping[tuple[str, str], Manifest]:
    found: dict[tuple[str, str], Manifest] = {}
    for namespace in sorted({namespace for namespace, _ in keys}):
        refs = [ref for where, ref in keys if where == namespace]
        listed = await kube.list_checkpoint_snapshots(namespace, refs)
        found.update({(namespace, name): obj for name, obj in listed.items()})
    return found
