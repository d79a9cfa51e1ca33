"""A CalibanTask's phases, and the markers of a task that never ran."""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class Phase(StrEnum):
    PENDING = "Pending"
    PROVISIONING = "Provisioning"
    RUNNING = "Running"
    DRAINING = "Draining"
    SUSPENDED = "Suspended"
    RESUMING = "Resuming"
    COMPLETED = "Completed"
    FAILED = "Failed"


CREATED_SUSPENDED: Final = "created-suspended"
"""``status.pausedBy`` of a task created with ``spec.lifecycle.suspend: true``: it never
started, so it has no checkpoint to resume from (beside ``idle`` and ``manual``)."""

ROLLED: Final = "roll"
"""``status.pausedBy`` of a task paused to roll its pod (a spec edit changed what the pod
is made of): it resumes on a new pod as soon as the old one is gone."""
