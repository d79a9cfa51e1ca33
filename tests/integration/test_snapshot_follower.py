"""The operator's snapshot follower (``orchestrator.operator.snapshot_follower``) against
the embedded Kubernetes API (with the external-snapshotter's CRDs, VolumeSnapshots in the
states the snapshotter writes) and a SQLite ledger: what it records of each snapshot,
where it says so (an event on a task that still exists, a log line otherwise), whom it
wakes, and what one look costs: one ledger read and, with anything to follow, one list of
VolumeSnapshots per namespace, never a GET per snapshot; at rest, no API request at all.

The API records every request it serves (``--record-requests``, ``authz``), so the cost
is counted, not assumed. The deadlines are the project's defaults: a checkpoint past its
ready deadline is one recorded that long ago.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client
from kubernetes import config as kube_config
from sqlalchemy import update

from orchestrator.devcluster import EmbeddedApiServer
from orchestrator.devcluster.authz import read_record
from orchestrator.devcluster.kubeconfig import kubeconfig_document
from orchestrator.devcluster.up import packaged_crds, stack_access
from orchestrator.ledger import (
    CheckpointReason,
    Ledger,
    OperationKind,
    OperationState,
    create_ledger_engine,
)
from orchestrator.ledger.models import Checkpoint
from orchestrator.operator import crd, events
from orchestrator.operator.kube import MERGE_PATCH
from orchestrator.operator.snapshot_follower import SnapshotFollower
from orchestrator.settings import Settings
from tests.pipeline_support import fresh_sqlite
from tests.support import LoopThread

T = TypeVar("T")
CUT = datetime(2026, 12, 6, 9, 0, 2, tzinfo=UTC)


class Api:
    """An :class:`EmbeddedApiServer` with the packaged CRDs on its own event-loop thread,
    recording its requests, and the official client configured for it."""

    def __init__(self, root: Path) -> None:
        self.record = root / "requests.jsonl"
        self._loop = LoopThread("embedded-api")
        self.server = self._loop.run(self._start())
        kube_config.load_kube_config_from_dict(kubeconfig_document(self.server.url))

    async def _start(self) -> EmbeddedApiServer:
        access = stack_access(False, self.record)
        server = EmbeddedApiServer(crds=packaged_crds(snapshots=True), access=access)
        await server.start()
        return server

    def close(self) -> None:
        self._loop.run(self.server.stop())
        self._loop.close()

    def requests(self) -> Counter[tuple[str, str, str]]:
        """(verb, resource, namespace) of every request served since the last call."""
        served = read_record(self.record) if self.record.exists() else []
        self.record.unlink(missing_ok=True)
        return Counter((r.verb, r.resource, r.namespace) for r in served)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    served = Api(tmp_path)
    try:
        yield served
    finally:
        served.close()


def checkpoint_of(
    ledger: Ledger, namespace: str, task: str, uid: str, *, pvc: str | None = None
) -> str:
    op = ledger.begin_operation(
        OperationKind.DELETE_DRAIN, task_uid=uid, namespace=namespace, name=task,
        idempotency_key=f"{uid}:delete",
    )  # fmt: skip
    ledger.transition(op.id, OperationState.DRAINING)
    return ledger.record_checkpoint(
        op.id, [], reason=CheckpointReason.DELETE, pvc_name=pvc or f"{task}-ws"
    ).ref


def volume_snapshot(namespace: str, ref: str, status: dict[str, Any]) -> None:
    """VolumeSnapshot ``ref`` of the checkpoint, its status as the snapshotter writes it."""
    objects = client.CustomObjectsApi()
    body = {
        "apiVersion": crd.SNAPSHOT_API_VERSION, "kind": crd.SNAPSHOT_KIND,
        "metadata": {"name": ref, "namespace": namespace,
                     "labels": {crd.CHECKPOINT_LABEL: ref}},
        "spec": {"source": {"persistentVolumeClaimName": "ws"}},
    }  # fmt: skip
    objects.create_namespaced_custom_object(
        crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, namespace, crd.SNAPSHOT_PLURAL, body
    )
    objects.patch_namespaced_custom_object_status(
        crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, namespace, crd.SNAPSHOT_PLURAL, ref,
        {"status": status}, _content_type=MERGE_PATCH,
    )  # fmt: skip


def cut_status(ready: bool) -> dict[str, Any]:
    return {
        "boundVolumeSnapshotContentName": "snapcontent-1",
        "creationTime": "2026-12-06T09:00:02Z",
        "readyToUse": ready,
        "restoreSize": "1Gi",
    }


def task(namespace: str, name: str) -> str:
    """A CalibanTask ``namespace/name``; its uid."""
    created = client.CustomObjectsApi().create_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL,
        {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND,
         "metadata": {"name": name}, "spec": {"task": {"agents": 1}}},
    )  # fmt: skip
    return str(created["metadata"]["uid"])


def events_of(namespace: str, name: str) -> list[tuple[str, str, str]]:
    listed = client.CoreV1Api().list_namespaced_event(namespace).items
    return [(e.type, e.reason, e.message) for e in listed if e.involved_object.name == name]


def test_one_look_records_ready_and_failed_snapshots_with_one_list_per_namespace(
    api: Api, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Tried, in two namespaces, every snapshot cut and followed: one still uploading,
    one ready, one deleted (of a task gone, its PVC gone too), one cut over an hour after
    its checkpoint and still not ready (of a task that exists, its PVC retained); a
    checkpoint with a ready snapshot and one without any, which are not followed."""
    core = client.CoreV1Api()
    for namespace in ("team-a", "team-b"):
        core.create_namespace({"metadata": {"name": namespace}})
    core.create_namespaced_persistent_volume_claim(
        "team-a", {"metadata": {"name": "late-ws"},
                   "spec": {"accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": "1Gi"}}}},
    )  # fmt: skip
    ready_uid, late_uid = task("team-a", "ready-task"), task("team-a", "late-task")
    url = fresh_sqlite(tmp_path)
    ledger = Ledger.from_url(url)
    try:
        uploading = checkpoint_of(ledger, "team-a", "uploading-task", "uid-uploading")
        ready = checkpoint_of(ledger, "team-a", "ready-task", ready_uid)
        late = checkpoint_of(ledger, "team-a", "late-task", late_uid, pvc="late-ws")
        deleted = checkpoint_of(ledger, "team-b", "deleted-task", "uid-deleted")
        settled = checkpoint_of(ledger, "team-b", "settled-task", "uid-settled")
        checkpoint_of(ledger, "team-b", "unsnapshotted-task", "uid-unsnapshotted")
        for ref in (uploading, ready, late, deleted):
            ledger.record_snapshot(ref, ref, cut_at=CUT)
        ledger.record_snapshot(settled, settled, ready_at=CUT)
        engine = create_ledger_engine(url)
        with engine.begin() as connection:  # recorded over an hour ago
            connection.execute(
                update(Checkpoint).where(Checkpoint.ref == late).values(
                    created_at=datetime.now(UTC) - timedelta(seconds=3601)
                )
            )  # fmt: skip
        engine.dispose()
        volume_snapshot("team-a", uploading, cut_status(ready=False))
        volume_snapshot("team-a", ready, cut_status(ready=True))
        volume_snapshot("team-a", late, {**cut_status(ready=False),
                                         "error": {"message": "upload throttled"}})  # fmt: skip
        volume_snapshot("team-b", settled, cut_status(ready=True))
        stewards = events.WorkQueue()
        ready_steward = stewards.open(("team-a", "ready-task"))
        late_steward = stewards.open(("team-a", "late-task"))
        follower = SnapshotFollower(ledger, Settings(), stewards)
        api.requests()

        with caplog.at_level(logging.INFO, "orchestrator.operator.snapshot_follower"):
            assert asyncio.run(follower.look()) == 4

        assert api.requests() == Counter({
            ("list", "volumesnapshots", "team-a"): 1,
            ("list", "volumesnapshots", "team-b"): 1,
            # Of each settled snapshot, once: its task (an event if it exists) and, for a
            # failed one, its retained PVC.
            ("get", "calibantasks", "team-a"): 2,
            ("get", "calibantasks", "team-b"): 1,
            ("create", "events", "team-a"): 2,
            ("get", "persistentvolumeclaims", "team-a"): 1,
            ("get", "persistentvolumeclaims", "team-b"): 1,
        })  # fmt: skip
        now = {ref: ledger.get_checkpoint(ref) for ref in (uploading, ready, late, deleted)}
        assert now[uploading].snapshot_pending  # type: ignore[union-attr]
        assert now[ready].snapshot == ready  # type: ignore[union-attr]
        assert now[late].snapshot_error == (  # type: ignore[union-attr]
            f"VolumeSnapshot {late} of PVC late-ws, cut at 2026-12-06T09:00:02Z, was not "
            "readyToUse within 3600s of the checkpoint (the snapshotter says: upload throttled)"
        )
        assert now[late].available  # type: ignore[union-attr]  # its retained PVC is there
        assert now[deleted].snapshot_error == (  # type: ignore[union-attr]
            f"VolumeSnapshot {deleted} of PVC deleted-task-ws, cut at 2026-12-06T09:00:02Z, no "
            "longer exists: it was deleted before it was readyToUse"
        )
        assert now[deleted].unavailable == (  # type: ignore[union-attr]
            f"its VolumeSnapshot failed ({now[deleted].snapshot_error}) and its workspace "  # type: ignore[union-attr]
            "PVC team-b/deleted-task-ws no longer exists"
        )
        assert events_of("team-a", "ready-task") == [
            ("Normal", "Snapshotted", f"checkpoint {ready}: workspace PVC ready-task-ws copied "
                                      f"to VolumeSnapshot {ready}, ready to restore"),
        ]  # fmt: skip
        assert events_of("team-a", "late-task") == [
            ("Warning", "SnapshotFailed", f"checkpoint {late} has no snapshot: "
             f"{now[late].snapshot_error}; it is kept as the retained workspace PVC late-ws "  # type: ignore[union-attr]
             "only"),
        ]  # fmt: skip
        assert (ready_steward.cause, late_steward.cause) == ("snapshot", "snapshot")
        assert f"snapshot_failed checkpoint={deleted}" in caplog.text
        assert "task=team-b/deleted-task task_exists=False" in caplog.text

        # A restore waiting for the uploading one is woken once it is ready, not before.
        restoring = stewards.open(("team-a", "restoring"))
        follower.wait_for_ready("team-a", uploading, ("team-a", "restoring"))
        assert asyncio.run(follower.look()) == 1
        assert api.requests()[("list", "volumesnapshots", "team-a")] == 1
        assert restoring.cause is None
        client.CustomObjectsApi().patch_namespaced_custom_object_status(
            crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, "team-a", crd.SNAPSHOT_PLURAL, uploading,
            {"status": {"readyToUse": True}}, _content_type=MERGE_PATCH,
        )  # fmt: skip
        assert asyncio.run(follower.look()) == 1
        assert restoring.cause == "snapshot"
        assert ledger.get_checkpoint(uploading).snapshot == uploading  # type: ignore[union-attr]
        api.requests()

        # At rest: nothing unsettled, one ledger read, no request to the API.
        assert asyncio.run(follower.look()) == 0
        assert api.requests() == Counter()
    finally:
        ledger.dispose()
