"""Operator failover: which replica acts, and how soon a standby takes over.

``drainctl operator --peering NAME`` runs kopf with peering: every replica writes a
keep-alive (its priority and lifetime) into the status of the peering object ``NAME``
(``crds/kopf-peering.yaml``; a ClusterKopfPeering for a clusterwide operator), and a
replica that sees a live peer of higher *or equal* priority pauses. Equal priorities
would pause them all, so each replica gets its own: by default the earlier-started one
ranks higher (:func:`startup_priority`), so a replica that joins (a rollout, a pod
rescheduled) stands by instead of pre-empting the one in the middle of a drain.

A standby resumes once the active replica's keep-alive is older than its lifetime
(``DRAIN_PEERING_LIFETIME_SECS``): a replica killed outright is replaced within that
bound (plus one watch event); one stopped cleanly withdraws its keep-alive on the way
out, and the standby resumes at once. The handlers need no lock of their own: every
operation is found in the ledger by its idempotency key, so the replica that takes over
continues the drain the dead one began (``handlers``).

Nothing here imports kopf: these are the pure decisions ``main.run_operator`` uses.
"""

from __future__ import annotations

import random
import time
from typing import Final

TIEBREAK_RANGE: Final = 1000
"""Distinct priorities for replicas started in the same millisecond."""


def startup_priority(started_at: float, tiebreak: int) -> int:
    """The peering priority of a replica started at ``started_at`` (epoch seconds):
    higher for an earlier start, ``tiebreak`` (0 ≤ it < :data:`TIEBREAK_RANGE`) telling
    apart replicas of the same millisecond. Stays within JSON's exact integers."""
    if not 0 <= tiebreak < TIEBREAK_RANGE:
        raise ValueError(f"tiebreak {tiebreak} is not in [0, {TIEBREAK_RANGE})")
    return -(int(started_at * 1000) * TIEBREAK_RANGE + tiebreak)


def own_priority(configured: int | None) -> int:
    """``DRAIN_PEERING_PRIORITY`` when set, else this process's :func:`startup_priority`."""
    if configured is not None:
        return configured
    return startup_priority(time.time(), random.randrange(TIEBREAK_RANGE))
