"""``drainctl ledger prune`` in batches against the embedded Kubernetes API and a SQLite
ledger: the dry run changes nothing, the real run releases each old checkpoint's
VolumeSnapshot and retained PVC ``--batch`` at a time and marks it unavailable, and
keeps the newest of each task with its storage. (The end-to-end test with live tasks
that name checkpoints is ``tests/e2e/test_checkpoints.py``.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from orchestrator.cli import ExitCode
from orchestrator.ledger import CheckpointReason, Ledger, OperationKind
from orchestrator.operator import crd
from tests.integration.cli_support import drainctl
from tests.pipeline_support import fresh_sqlite
from tests.support import wait_until

TASKS = 4
NAMESPACE = "default"


class Cluster:
    def __init__(self, kubeconfig: Path) -> None:
        api = config.new_client_from_config(str(kubeconfig))
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)

    def make_pvc(self, name: str) -> None:
        self.core.create_namespaced_persistent_volume_claim(NAMESPACE, {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "1Gi"}}},
        })  # fmt: skip

    def make_snapshot(self, name: str, pvc: str) -> None:
        self.custom.create_namespaced_custom_object(
            crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, NAMESPACE, crd.SNAPSHOT_PLURAL, {
                "apiVersion": crd.SNAPSHOT_API_VERSION, "kind": crd.SNAPSHOT_KIND,
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"source": {"persistentVolumeClaimName": pvc}},
            },
        )  # fmt: skip

    def pvc_exists(self, name: str) -> bool:
        return self._exists(self.core.read_namespaced_persistent_volume_claim, name, NAMESPACE)

    def snapshot_exists(self, name: str) -> bool:
        return self._exists(
            self.custom.get_namespaced_custom_object,
            crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, NAMESPACE, crd.SNAPSHOT_PLURAL, name,
        )  # fmt: skip

    @staticmethod
    def _exists(read: Callable[..., object], *args: str) -> bool:
        try:
            read(*args)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True


@pytest.fixture
def history(
    tmp_path: Path, dev_cluster: Path
) -> Iterator[tuple[Cluster, Ledger, str, list[tuple[str, str]], list[tuple[str, str]]]]:
    """Tasks ``t0..t3`` (none live), each with an old checkpoint on PVC ``old-i`` and a
    newer one on PVC ``new-i``, every checkpoint with its ready VolumeSnapshot: yields the
    cluster, the ledger, its URL, and the old and the new (ref, PVC)s."""
    cluster, url = Cluster(dev_cluster), fresh_sqlite(tmp_path)
    ledger = Ledger.from_url(url)
    old: list[tuple[str, str]] = []
    new: list[tuple[str, str]] = []
    for generation, kept in (("old", old), ("new", new)):
        for i in range(TASKS):
            op = ledger.begin_operation(
                OperationKind.PAUSE, task_uid=f"uid-{i}", namespace=NAMESPACE, name=f"t{i}",
                idempotency_key=f"{generation}-{i}",
            )  # fmt: skip
            pvc = f"{generation}-{i}"
            ref = ledger.record_checkpoint(
                op.id, [], reason=CheckpointReason.PAUSE, pvc_name=pvc
            ).ref
            cluster.make_pvc(pvc)
            cluster.make_snapshot(ref, pvc)
            ledger.record_snapshot(ref, ref, ready_at=datetime.now(UTC))
            kept.append((ref, pvc))
    try:
        yield cluster, ledger, url, old, new
    finally:
        ledger.dispose()


def prune(url: str, kubeconfig: Path, *args: str) -> Any:
    return drainctl("ledger", "prune", "--kubeconfig", str(kubeconfig), *args,
                    env={"DRAIN_DATABASE_URL": url}, timeout=120)  # fmt: skip


def test_prune_releases_old_checkpoints_and_their_pvcs_a_batch_at_a_time(
    history: tuple[Cluster, Ledger, str, list[tuple[str, str]], list[tuple[str, str]]],
    dev_cluster: Path,
) -> None:
    """Tried: ledger prune --keep 1 --batch 3, first with --dry-run (human and --json),
    then for real, on 4 tasks of 2 checkpoints each."""
    cluster, ledger, url, old, new = history

    dry = prune(url, dev_cluster, "--keep", "1", "--batch", "3", "--dry-run", "--json")
    assert dry.returncode == ExitCode.OK, dry.stderr
    plan = json.loads(dry.stdout)
    assert (plan["dry_run"], plan["batch"]) == (True, 3)
    actions = {i["ref"]: (i["action"], i["snapshot"], i["pvc"]) for i in plan["checkpoints"]}
    assert actions == {
        **{ref: ("release", ref, pvc) for ref, pvc in old},
        **{ref: ("keep", ref, None) for ref, _ in new},
    }
    human = prune(url, dev_cluster, "--keep", "1", "--batch", "3", "--dry-run")
    assert human.stdout.splitlines()[-1] == (
        "would release 4 of 8 checkpoints in 2 batches of at most 3: 4 VolumeSnapshots, "
        "4 PVCs; nothing was changed (--dry-run)"
    )
    assert all(cluster.pvc_exists(pvc) and cluster.snapshot_exists(ref) for ref, pvc in old)
    assert all(ledger.get_checkpoint(ref).available for ref, _ in old)  # type: ignore[union-attr]

    real = prune(url, dev_cluster, "--keep", "1", "--batch", "3")
    assert real.returncode == ExitCode.OK, real.stderr
    assert real.stderr.splitlines() == [
        "released 3 of 4 checkpoints", "released 4 of 4 checkpoints"
    ]  # fmt: skip
    assert real.stdout.splitlines()[-1].startswith("released 4 of 8 checkpoints in 2 batches")
    for ref, pvc in old:
        released = ledger.get_checkpoint(ref)
        assert released is not None and not released.available
        assert f"(VolumeSnapshot {ref} and PVC {pvc})" in str(released.unavailable)
        assert not cluster.snapshot_exists(ref)
        wait_until(lambda pvc=pvc: not cluster.pvc_exists(pvc), 30, f"PVC {pvc} to be deleted")  # type: ignore[misc]
    for ref, pvc in new:
        assert ledger.get_checkpoint(ref).available  # type: ignore[union-attr]
        assert cluster.pvc_exists(pvc) and cluster.snapshot_exists(ref)

    again = prune(url, dev_cluster, "--keep", "1", "--batch", "3")
    assert again.returncode == ExitCode.OK, again.stderr
    assert again.stdout.splitlines()[-1].startswith("released 0 of 4 checkpoints in 0 batches")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [(["--batch", "0"], "0 is not in the range x>=1"),
     (["--batch", "many"], "'many' is not a valid integer")],
    ids=["zero-batch", "word-batch"],
)  # fmt: skip
def test_prune_with_a_bad_batch_or_keep_is_a_usage_error(
    tmp_path: Path, args: list[str], fragment: str
) -> None:
    """Tried: ledger prune with a batch that is not a positive integer."""
    result = drainctl("ledger", "prune", *args,
                      env={"DRAIN_DATABASE_URL": fresh_sqlite(tmp_path)})  # fmt: skip
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr


def test_a_restore_applied_after_the_plan_keeps_its_checkpoint_at_the_release(
    history: tuple[Cluster, Ledger, str, list[tuple[str, str]], list[tuple[str, str]]],
    dev_cluster: Path,
) -> None:
    """Tried: a prune planned from a look at the cluster where no task names anything (it
    releases every old checkpoint), then a CalibanTask restoring ``old-0``'s checkpoint
    created before the plan is carried out; then that task's claim in the ledger.

    The release marks each batch in the ledger, looks at the cluster again, and keeps
    what a live task names now: the restore's snapshot and PVC stay and it can still be
    claimed; the rest of the plan is released as planned."""
    from orchestrator.operator.retention import PruneAction, plan_prune, release

    cluster, ledger, _, old, _ = history
    config.load_kube_config(config_file=str(dev_cluster))
    now = datetime.now(UTC)
    items = plan_prune(
        ledger.list_checkpoints(limit=100), keep=1, older_than_secs=0, now=now,
        named_by_tasks={}, held_pvcs={},
    )  # fmt: skip
    (restored, restored_pvc), *released = old
    assert {i.ref for i in items if i.action is PruneAction.RELEASE} == {r for r, _ in old}
    cluster.custom.create_namespaced_custom_object(
        crd.GROUP, crd.VERSION, NAMESPACE, crd.PLURAL, {
            "apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND,
            "metadata": {"name": "restorer", "namespace": NAMESPACE},
            "spec": {"task": {"agents": 1, "provider": "scripted", "model": "turns=1"},
                     "resumeFrom": {"checkpointRef": restored}},
        },
    )  # fmt: skip

    done = {i.ref: i for i in asyncio.run(release(ledger, items, now, batch=2))}

    kept = done[restored]
    assert (kept.action, kept.pvc) == (PruneAction.KEEP, None)
    assert kept.why == (
        "restored by task default/restorer (spec.resumeFrom): seen when it was about to be released"
    )
    assert cluster.snapshot_exists(restored) and cluster.pvc_exists(restored_pvc)
    claim = ledger.claim_for_restore(restored)
    assert claim is not None and claim.available and claim.releasing_since is None
    assert claim.restore_claimed_at is not None
    for ref, pvc in released:
        assert done[ref].action is PruneAction.RELEASE
        assert not cluster.snapshot_exists(ref)
        wait_until(lambda pvc=pvc: not cluster.pvc_exists(pvc), 30, f"PVC {pvc} to be deleted")  # type: ignore[misc]
        gone = ledger.get_checkpoint(ref)
        assert gone is not None and f"(VolumeSnapshot {ref} and PVC {pvc})" in str(gone.unavailable)
        refused = ledger.claim_for_restore(ref)
        assert refused is not None and refused.restore_claimed_at is None
