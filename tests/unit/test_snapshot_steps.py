"""A checkpoint's VolumeSnapshot as the external-snapshotter writes it, and what the
operator records of it (``orchestrator.operator.lifecycle.snapshots``): pending (asked
for, not cut), cut (``creationTime`` set and bound to its content: its point in time
fixed, its data perhaps still uploading), ready (``readyToUse``), failed; and when a
pause or a deletion may go on (at the cut) and a restore (at ready).

The deadlines are the project's defaults (``Settings()``: 300 s to the cut, 3600 s to
ready, both from the checkpoint), never shortened: each is shown to hold exactly at its
default through the pure function.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from orchestrator.operator.lifecycle import (
    FollowedSnapshot,
    SnapshotOutcome,
    SnapshotProgress,
    SnapshotState,
    SnapshotStep,
    snapshot_state,
    snapshot_step,
)
from orchestrator.settings import Settings

CHECKPOINTED = datetime(2026, 12, 6, 9, 0, 0, tzinfo=UTC)
CUT = datetime(2026, 12, 6, 9, 0, 2, tzinfo=UTC)
CONTENT = "snapcontent-72d9a349-aacd-42d2-a240-d775650d2455"


def later(secs: float) -> datetime:
    return CHECKPOINTED + timedelta(seconds=secs)


def volume_snapshot(status: dict[str, Any] | None, **meta: Any) -> dict[str, Any]:
    """A VolumeSnapshot of PVC ``ws`` in class ``csi-snapclass``, with ``status`` as the
    snapshot controller writes it (None: none yet)."""
    body: dict[str, Any] = {
        "apiVersion": "snapshot.storage.k8s.io/v1",
        "kind": "VolumeSnapshot",
        "metadata": {"name": "ckpt-a", "namespace": "default", "uid": "vs-uid", **meta},
        "spec": {"source": {"persistentVolumeClaimName": "ws"},
                 "volumeSnapshotClassName": "csi-snapclass"},
    }  # fmt: skip
    if status is not None:
        body["status"] = status
    return body


# ------------------------------------------------ what a VolumeSnapshot says about its copy


@pytest.mark.parametrize(
    ("snapshot", "state"),
    [
        pytest.param(volume_snapshot(None), SnapshotState(SnapshotProgress.PENDING),
                     id="just-created-no-status"),
        pytest.param(volume_snapshot({"boundVolumeSnapshotContentName": CONTENT,
                                      "readyToUse": False}),
                     SnapshotState(SnapshotProgress.PENDING),
                     id="bound-to-its-content-not-cut-yet"),
        pytest.param(volume_snapshot({"creationTime": "2026-12-06T09:00:02Z",
                                      "readyToUse": False}),
                     SnapshotState(SnapshotProgress.PENDING),
                     id="a-creation-time-without-content-is-not-cut"),
        pytest.param(volume_snapshot({"readyToUse": False, "error": {
                         "message": "Failed to check and update snapshot content: "
                                    "failed to take snapshot of the volume",
                         "time": "2026-12-06T09:00:01Z"}}),
                     SnapshotState(SnapshotProgress.PENDING,
                                   "Failed to check and update snapshot content: failed to "
                                   "take snapshot of the volume"),
                     id="an-error-before-the-cut"),
        pytest.param(volume_snapshot({"boundVolumeSnapshotContentName": CONTENT,
                                      "creationTime": "2026-12-06T09:00:02Z",
                                      "readyToUse": False, "restoreSize": "1Gi"}),
                     SnapshotState(SnapshotProgress.CUT, None, "1Gi", CUT),
                     id="cut-uploading"),
        pytest.param(volume_snapshot({"boundVolumeSnapshotContentName": CONTENT,
                                      "creationTime": "2026-12-06T09:00:02Z",
                                      "readyToUse": False, "error": {
                                          "message": "snapshot upload throttled",
                                          "time": "2026-12-06T09:03:00Z"}}),
                     SnapshotState(SnapshotProgress.CUT, "snapshot upload throttled", None, CUT),
                     id="cut-with-an-error-while-uploading"),
        pytest.param(volume_snapshot({"boundVolumeSnapshotContentName": CONTENT,
                                      "creationTime": "2026-12-06T09:00:02Z",
                                      "readyToUse": True, "restoreSize": "1Gi"}),
                     SnapshotState(SnapshotProgress.READY, None, "1Gi", CUT),
                     id="ready"),
        pytest.param(volume_snapshot({"boundVolumeSnapshotContentName": CONTENT,
                                      "creationTime": "2026-12-06T09:00:02Z",
                                      "readyToUse": False},
                                     deletionTimestamp="2026-12-06T09:01:00Z"),
                     SnapshotState(SnapshotProgress.MISSING), id="cut-and-being-deleted"),
        pytest.param(None, SnapshotState(SnapshotProgress.MISSING), id="gone"),
    ],
)  # fmt: skip
def test_a_volume_snapshot_is_pending_then_cut_then_ready_as_the_snapshotter_writes_it(
    snapshot: dict[str, Any] | None, state: SnapshotState
) -> None:
    assert snapshot_state(snapshot) == state


@pytest.mark.parametrize(
    ("progress", "cut"),
    [(SnapshotProgress.PENDING, False), (SnapshotProgress.CUT, True),
     (SnapshotProgress.READY, True), (SnapshotProgress.MISSING, False)],
    ids=["pending", "cut", "ready", "missing"],
)  # fmt: skip
def test_a_pause_or_a_deletion_may_go_on_once_the_snapshot_is_cut_or_ready(
    progress: SnapshotProgress, cut: bool
) -> None:
    assert SnapshotState(progress).cut is cut


# ---------------------------------------------------------- what to record next

NOT_CUT = SnapshotState(SnapshotProgress.PENDING)
NOT_CUT_ERROR = SnapshotState(SnapshotProgress.PENDING, 'persistentvolumeclaim "ws" not found')
SEEN_CUT = SnapshotState(SnapshotProgress.CUT, None, "1Gi", CUT)
SEEN_CUT_ERROR = SnapshotState(SnapshotProgress.CUT, "snapshot upload throttled", "1Gi", CUT)
SEEN_READY = SnapshotState(SnapshotProgress.READY, None, "1Gi", CUT)
GONE = SnapshotState(SnapshotProgress.MISSING)
ASKED = FollowedSnapshot("ckpt-a", "ws", CHECKPOINTED)
RECORDED_CUT = FollowedSnapshot("ckpt-a", "ws", CHECKPOINTED, cut_at=CUT)


@pytest.mark.parametrize(
    ("followed", "state", "secs", "step"),
    [
        pytest.param(ASKED, NOT_CUT, 10, SnapshotStep(SnapshotOutcome.WAIT),
                     id="not-cut-yet-waits"),
        pytest.param(ASKED, NOT_CUT_ERROR, 10, SnapshotStep(SnapshotOutcome.WAIT),
                     id="an-error-before-the-cut-is-retried-by-the-snapshotter"),
        pytest.param(ASKED, GONE, 10, SnapshotStep(SnapshotOutcome.WAIT),
                     id="not-listed-before-the-cut-waits"),
        pytest.param(ASKED, SEEN_CUT, 3, SnapshotStep(SnapshotOutcome.CUT, cut_at=CUT),
                     id="cut-is-recorded-with-its-creation-time"),
        pytest.param(ASKED, SEEN_READY, 3,
                     SnapshotStep(SnapshotOutcome.READY, cut_at=CUT, ready_at=later(3)),
                     id="ready-at-once-records-the-cut-too"),
        pytest.param(RECORDED_CUT, SEEN_CUT, 120, SnapshotStep(SnapshotOutcome.WAIT),
                     id="cut-as-recorded-waits-for-ready"),
        pytest.param(RECORDED_CUT, SEEN_CUT_ERROR, 120, SnapshotStep(SnapshotOutcome.WAIT),
                     id="an-error-while-uploading-is-retried-by-the-snapshotter"),
        pytest.param(RECORDED_CUT, SEEN_READY, 300,
                     SnapshotStep(SnapshotOutcome.READY, cut_at=CUT, ready_at=later(300)),
                     id="ready-after-the-cut"),
        pytest.param(ASKED, NOT_CUT, 301, SnapshotStep(
                         SnapshotOutcome.FAILED,
                         error="VolumeSnapshot ckpt-a of PVC ws was not cut within 300s"),
                     id="not-cut-within-the-cut-timeout-fails"),
        pytest.param(ASKED, NOT_CUT_ERROR, 301, SnapshotStep(
                         SnapshotOutcome.FAILED,
                         error="VolumeSnapshot ckpt-a of PVC ws was not cut within 300s (the "
                               'snapshotter says: persistentvolumeclaim "ws" not found)'),
                     id="an-error-before-the-cut-fails-at-the-cut-timeout"),
        pytest.param(ASKED, GONE, 301, SnapshotStep(
                         SnapshotOutcome.FAILED,
                         error="VolumeSnapshot ckpt-a of PVC ws was not cut within 300s and "
                               "no longer exists"),
                     id="gone-before-the-cut-fails-at-the-cut-timeout"),
        pytest.param(RECORDED_CUT, GONE, 60, SnapshotStep(
                         SnapshotOutcome.FAILED,
                         error="VolumeSnapshot ckpt-a of PVC ws, cut at 2026-12-06T09:00:02Z, "
                               "no longer exists: it was deleted before it was readyToUse"),
                     id="gone-after-the-cut-fails-at-once"),
        pytest.param(RECORDED_CUT, SEEN_CUT_ERROR, 3601, SnapshotStep(
                         SnapshotOutcome.FAILED,
                         error="VolumeSnapshot ckpt-a of PVC ws, cut at 2026-12-06T09:00:02Z, "
                               "was not readyToUse within 3600s of the checkpoint (the "
                               "snapshotter says: snapshot upload throttled)"),
                     id="an-error-after-the-cut-fails-at-the-ready-timeout"),
        pytest.param(ASKED, SEEN_CUT, 3601, SnapshotStep(
                         SnapshotOutcome.FAILED,
                         error="VolumeSnapshot ckpt-a of PVC ws, cut at 2026-12-06T09:00:02Z, "
                               "was not readyToUse within 3600s of the checkpoint"),
                     id="cut-unrecorded-and-not-ready-in-time-fails"),
    ],
)  # fmt: skip
def test_what_the_ledger_records_of_a_snapshot_next(
    followed: FollowedSnapshot, state: SnapshotState, secs: float, step: SnapshotStep
) -> None:
    assert (
        snapshot_step(followed, state, later(secs), cut_timeout_secs=300, ready_timeout_secs=3600)
        == step
    )


@pytest.fixture
def defaults(monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings with no ``DRAIN_*`` variable set: the project's defaults."""
    for variable in [v for v in os.environ if v.startswith("DRAIN_")]:
        monkeypatch.delenv(variable)
    return Settings()


def step_at(
    settings: Settings, followed: FollowedSnapshot, state: SnapshotState, secs: float
) -> SnapshotOutcome:
    return snapshot_step(
        followed,
        state,
        later(secs),
        cut_timeout_secs=settings.snapshot_cut_timeout_secs,
        ready_timeout_secs=settings.snapshot_ready_timeout_secs,
    ).outcome


def test_by_default_a_snapshot_not_cut_fails_just_after_300s(defaults: Settings) -> None:
    assert step_at(defaults, ASKED, NOT_CUT, 300) is SnapshotOutcome.WAIT
    assert step_at(defaults, ASKED, NOT_CUT, 300.5) is SnapshotOutcome.FAILED


def test_by_default_a_cut_snapshot_not_ready_fails_just_after_an_hour(defaults: Settings) -> None:
    """A cut snapshot holds no pod: it may upload for an hour from its checkpoint, and its
    cut deadline no longer applies to it."""
    assert step_at(defaults, RECORDED_CUT, SEEN_CUT, 301) is SnapshotOutcome.WAIT
    assert step_at(defaults, RECORDED_CUT, SEEN_CUT, 3600) is SnapshotOutcome.WAIT
    assert step_at(defaults, RECORDED_CUT, SEEN_CUT, 3600.5) is SnapshotOutcome.FAILED
    assert step_at(defaults, RECORDED_CUT, SEEN_READY, 3599) is SnapshotOutcome.READY


def test_a_ready_deadline_before_the_cut_deadline_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"DRAIN_SNAPSHOT_READY_TIMEOUT_SECS \(60 s\) must be "
        r"at least DRAIN_SNAPSHOT_CUT_TIMEOUT_SECS \(300 s\)",
    ):
        Settings(snapshot_ready_timeout_secs=60)
