"""CSI volume snapshots in the dev stack, as the operator and a user meet them: ``drainctl
dev up`` as a real subprocess (``orchestrator.testing.DevStackProcess``: the embedded API
with the external-snapshotter's CRDs, the stand-in Sandbox controller and its stand-in
CSI driver) and the real ``kubectl`` binary.

A test stands in for a pod where it writes into a PVC's volume directory (that is what
the controller mounts). One stack serves the tests that need one; each works in a
namespace of its own. Restarts and ``--no-snapshots`` get stacks of their own."""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.devcluster.csi import DEV_CSI_DRIVER, DEV_SNAPSHOT_CLASS, snapshot_dir, volume_dir
from orchestrator.devcluster.up import SANDBOXES_DIR
from orchestrator.operator.crd import (
    SANDBOX_KIND,
    SANDBOX_V1ALPHA1,
    SNAPSHOT_API_VERSION,
    SNAPSHOT_CRD,
    SNAPSHOT_GROUP,
    SNAPSHOT_KIND,
)
from orchestrator.testing import DevStackProcess, wait_until

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs the kubectl binary")

READY_SECS = 10.0
"""How long a snapshot or a restore may take: the controller polls every 0.3 s."""


class Stack(DevStackProcess):
    """``drainctl dev up`` with the kubectl calls these tests make."""

    def kubectl(
        self, *args: str, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["kubectl", "--kubeconfig", str(self.kubeconfig), "--cache-dir",
             str(self.root / "kube-cache"), *args],
            capture_output=True, text=True, timeout=60, input=stdin, check=False,
        )  # fmt: skip
        if check:
            assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result

    def apply(self, *manifests: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(manifests))

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        where = ["-n", namespace] if namespace else []
        got = self.kubectl("get", kind, name, *where, "-o", "json", check=False)
        if got.returncode != 0:
            assert "NotFound" in got.stderr, got.stderr
            return None
        found: dict[str, Any] = json.loads(got.stdout)
        return found

    def wait_taken(self, namespace: str, name: str) -> dict[str, Any]:
        """VolumeSnapshot ``namespace/name`` once ready to use."""

        def taken() -> dict[str, Any] | None:
            snapshot = self.get("volumesnapshot", name, namespace)
            status = (snapshot or {}).get("status") or {}
            return snapshot if status.get("readyToUse") is True else None

        return wait_until(taken, READY_SECS, f"volumesnapshot {namespace}/{name} to be ready")

    def phase(self, namespace: str, pvc: str) -> str | None:
        """PVC ``pvc``'s ``status.phase``."""
        claim = self.get("pvc", pvc, namespace) or {}
        return (claim.get("status") or {}).get("phase")

    def volume(self, namespace: str, pvc: str) -> Path:
        return volume_dir(self.state / SANDBOXES_DIR, namespace, pvc)

    def copy_of(self, snapshot: dict[str, Any]) -> Path:
        return snapshot_dir(self.state / SANDBOXES_DIR, str(snapshot["metadata"]["uid"]))

    def mounted(self, namespace: str, pvc: str, files: dict[str, str]) -> Path:
        """PVC ``pvc``'s volume with ``files`` in it, as a pod would have written them."""
        volume = self.volume(namespace, pvc)
        volume.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (volume / name).write_text(text)
        return volume

    def api_url(self) -> str:
        config = yaml.safe_load(self.kubeconfig.read_text())
        server = str(config["clusters"][0]["cluster"]["server"])
        assert server.startswith("http://127.0.0.1:"), server
        return server


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running(tmp_path_factory.mktemp("stack")) as shared:
        yield shared


NAMESPACES = itertools.count(1)


@pytest.fixture
def namespace(stack: Stack) -> str:
    """A namespace of the test's own on the shared stack."""
    name = f"test-{next(NAMESPACES)}"
    stack.kubectl("create", "namespace", name)
    return name


def pvc(name: str, namespace: str, from_snapshot: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": "1Gi"}}}  # fmt: skip
    if from_snapshot is not None:
        spec["dataSource"] = {"apiGroup": SNAPSHOT_GROUP, "kind": SNAPSHOT_KIND,
                              "name": from_snapshot}  # fmt: skip
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}  # fmt: skip


def volume_snapshot(
    name: str, namespace: str, source: str, class_name: str | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"source": {"persistentVolumeClaimName": source}}
    if class_name is not None:
        spec["volumeSnapshotClassName"] = class_name
    return {"apiVersion": SNAPSHOT_API_VERSION, "kind": SNAPSHOT_KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}  # fmt: skip


# ---------------------------------------------------------------------------- taking


def test_a_snapshot_is_a_ready_copy_of_the_volume_as_it_was(stack: Stack, namespace: str) -> None:
    stack.apply(pvc("ws", namespace))
    volume = stack.mounted(namespace, "ws", {"session.json": "turn 1"})
    stack.apply(volume_snapshot("ck-1", namespace, "ws"))
    taken = stack.wait_taken(namespace, "ck-1")
    status = taken["status"]
    assert status["restoreSize"] == "1Gi"
    assert status["boundVolumeSnapshotContentName"] == f"snapcontent-{taken['metadata']['uid']}"
    assert "error" not in status
    # No class named: the default one, written into the spec as the snapshot controller does.
    assert taken["spec"]["volumeSnapshotClassName"] == DEV_SNAPSHOT_CLASS

    (volume / "session.json").write_text("turn 2")
    assert (stack.copy_of(taken) / "session.json").read_text() == "turn 1"

    header, row = stack.kubectl("get", "vs", "-n", namespace).stdout.splitlines()
    assert header.split() == ["NAME", "READYTOUSE", "SOURCEPVC", "SOURCESNAPSHOTCONTENT",
                              "RESTORESIZE", "SNAPSHOTCLASS", "SNAPSHOTCONTENT", "CREATIONTIME",
                              "AGE"]  # fmt: skip
    # SOURCESNAPSHOTCONTENT is empty (a snapshot of a PVC), so the row has one cell fewer.
    assert row.split()[:6] == ["ck-1", "true", "ws", "1Gi", DEV_SNAPSHOT_CLASS,
                               status["boundVolumeSnapshotContentName"]]  # fmt: skip
    assert row.split()[6].endswith("s")  # CREATIONTIME: an age, not a timestamp
    content = stack.get("volumesnapshotcontent", status["boundVolumeSnapshotContentName"])
    assert content is not None
    assert content["spec"]["driver"] == DEV_CSI_DRIVER
    assert content["spec"]["volumeSnapshotRef"]["uid"] == taken["metadata"]["uid"]
    assert content["status"]["readyToUse"] is True
    assert content["status"]["restoreSize"] == 1073741824
    assert content["status"]["snapshotHandle"] == taken["metadata"]["uid"]
    # The volume exists, so the PVC is Bound, as on a cluster.
    assert stack.phase(namespace, "ws") == "Bound"


def test_a_snapshot_of_a_missing_pvc_reports_it_until_the_pvc_is_there(
    stack: Stack, namespace: str
) -> None:
    stack.apply(volume_snapshot("early", namespace, "later"))

    def error() -> str | None:
        snapshot = stack.get("volumesnapshot", "early", namespace) or {}
        return str(((snapshot.get("status") or {}).get("error") or {}).get("message") or "")

    message = wait_until(error, READY_SECS, "the snapshot's status.error")
    assert message == f'persistentvolumeclaim "later" not found in namespace "{namespace}"'
    snapshot = stack.get("volumesnapshot", "early", namespace)
    assert snapshot is not None and snapshot["status"]["readyToUse"] is False

    stack.apply(pvc("later", namespace))
    stack.mounted(namespace, "later", {"notes.md": "hello"})
    taken = stack.wait_taken(namespace, "early")
    assert "error" not in taken["status"]
    assert (stack.copy_of(taken) / "notes.md").read_text() == "hello"


def test_a_snapshot_of_another_drivers_class_is_left_to_that_driver(
    stack: Stack, namespace: str
) -> None:
    other = {"apiVersion": SNAPSHOT_API_VERSION, "kind": "VolumeSnapshotClass",
             "metadata": {"name": f"other-{namespace}"}, "driver": "other.example.com",
             "deletionPolicy": "Delete"}  # fmt: skip
    stack.apply(other, pvc("ws", namespace))
    stack.mounted(namespace, "ws", {"a": "1"})
    stack.apply(volume_snapshot("theirs", namespace, "ws", class_name=f"other-{namespace}"))
    # Ours, created after theirs: every poll that takes it has seen theirs too.
    stack.apply(volume_snapshot("ours", namespace, "ws"))
    stack.wait_taken(namespace, "ours")
    theirs = stack.get("volumesnapshot", "theirs", namespace)
    assert theirs is not None and "status" not in theirs
    assert not stack.copy_of(theirs).exists()


def test_deleting_a_snapshot_removes_its_content_and_its_copy(stack: Stack, namespace: str) -> None:
    stack.apply(pvc("ws", namespace))
    stack.mounted(namespace, "ws", {"a": "1"})
    stack.apply(volume_snapshot("ck-1", namespace, "ws"))
    taken = stack.wait_taken(namespace, "ck-1")
    content = taken["status"]["boundVolumeSnapshotContentName"]
    copy = stack.copy_of(taken)
    assert copy.is_dir()

    stack.kubectl("delete", "volumesnapshot", "ck-1", "-n", namespace)
    wait_until(lambda: not copy.exists(), READY_SECS, "the snapshot's copy to go")
    assert stack.get("volumesnapshotcontent", content) is None
    assert (stack.volume(namespace, "ws") / "a").read_text() == "1"  # the source stays


# ---------------------------------------------------------------------------- restoring


def test_a_pvc_restored_from_a_snapshot_holds_its_own_copy(stack: Stack, namespace: str) -> None:
    stack.apply(pvc("ws", namespace))
    source = stack.mounted(namespace, "ws", {"session.json": "turn 1"})
    stack.apply(volume_snapshot("ck-1", namespace, "ws"))
    taken = stack.wait_taken(namespace, "ck-1")
    (source / "session.json").write_text("turn 2")

    stack.apply(pvc("restored", namespace, from_snapshot="ck-1"))
    restored = stack.volume(namespace, "restored")
    wait_until(lambda: (restored / "session.json").exists(), READY_SECS, "the restore")
    assert (restored / "session.json").read_text() == "turn 1"

    (restored / "session.json").write_text("turn 1, resumed")
    assert (source / "session.json").read_text() == "turn 2"
    assert (stack.copy_of(taken) / "session.json").read_text() == "turn 1"
    wait_until(lambda: stack.phase(namespace, "restored") == "Bound", READY_SECS, "Bound")
    # Deleting the snapshot afterwards leaves the restored volume alone.
    stack.kubectl("delete", "volumesnapshot", "ck-1", "-n", namespace)
    wait_until(lambda: not stack.copy_of(taken).exists(), READY_SECS, "the copy to go")
    assert (restored / "session.json").read_text() == "turn 1, resumed"


READER = (
    "import pathlib, sys, time\n"
    "volume = pathlib.Path(sys.argv[1])\n"
    "(volume / 'seen.txt').write_text((volume / 'session.json').read_text())\n"
    "time.sleep(600)\n"
)


def test_a_pod_mounting_a_pvc_to_be_restored_waits_for_its_snapshot(
    stack: Stack, namespace: str
) -> None:
    container = {"name": "reader", "command": [sys.executable, "-c", READER, "/workspace"],
                 "volumeMounts": [{"name": "workspace", "mountPath": "/workspace"}]}  # fmt: skip
    sandbox = {
        "apiVersion": SANDBOX_V1ALPHA1, "kind": SANDBOX_KIND,
        "metadata": {"name": "reader", "namespace": namespace},
        "spec": {"replicas": 1, "podTemplate": {"spec": {
            "terminationGracePeriodSeconds": 1, "containers": [container],
            "volumes": [{"name": "workspace", "persistentVolumeClaim": {"claimName": "restored"}}],
        }}},
    }  # fmt: skip
    stack.apply(pvc("restored", namespace, from_snapshot="ck-1"), sandbox)
    waiting = f"sandbox_pod_waiting sandbox={namespace}/reader pvc=restored"
    wait_until(lambda: waiting in stack.log_text(), READY_SECS, "the pod to wait")
    assert not stack.volume(namespace, "restored").exists()  # nothing ran on an empty volume

    stack.apply(pvc("ws", namespace))
    stack.mounted(namespace, "ws", {"session.json": "turn 7"})
    stack.apply(volume_snapshot("ck-1", namespace, "ws"))
    seen = stack.volume(namespace, "restored") / "seen.txt"
    wait_until(seen.exists, READY_SECS * 2, "the pod to start on the restored volume")
    assert seen.read_text() == "turn 7"
    assert stack.log_text().count(waiting) == 1  # said once, not once a poll
    stack.kubectl("delete", "sandbox", "reader", "-n", namespace)


# ---------------------------------------------------------------------------- the API


def test_the_snapshot_resources_serve_every_verb_kubectl_and_clients_use(
    stack: Stack, namespace: str
) -> None:
    """Through a class of another driver, so no driver writes the snapshot meanwhile."""
    resources = stack.kubectl("api-resources", f"--api-group={SNAPSHOT_GROUP}", "-o", "wide")
    rows = {line.split()[0]: line.split() for line in resources.stdout.splitlines()[1:]}
    assert rows["volumesnapshots"][1:5] == ["vs", f"{SNAPSHOT_API_VERSION}", "true",
                                            "VolumeSnapshot"]  # fmt: skip
    assert rows["volumesnapshotclasses"][3] == "false"
    assert rows["volumesnapshotcontents"][3] == "false"

    manual = {"apiVersion": SNAPSHOT_API_VERSION, "kind": "VolumeSnapshotClass",
              "metadata": {"name": f"manual-{namespace}"}, "driver": "manual.example.com",
              "deletionPolicy": "Retain"}  # fmt: skip
    stack.apply(manual)
    base = f"{stack.api_url()}/apis/{SNAPSHOT_API_VERSION}/namespaces/{namespace}/volumesnapshots"
    listed = json.loads(urllib.request.urlopen(base, timeout=10).read())
    stack.apply(volume_snapshot("manual", namespace, "ws", class_name=f"manual-{namespace}"))
    status = '{"status": {"readyToUse": true, "restoreSize": "2Gi"}}'
    stack.kubectl("patch", "vs", "manual", "-n", namespace, "--type", "merge", "-p", status,
                  "--subresource", "status")  # fmt: skip
    stack.kubectl("label", "vs", "manual", "-n", namespace, "checkpoint=ck-9")
    row = stack.kubectl("get", "vs", "-n", namespace, "-l", "checkpoint=ck-9").stdout
    assert row.splitlines()[1].split()[:4] == ["manual", "true", "ws", "2Gi"]
    stack.kubectl("delete", "vs", "manual", "-n", namespace)

    since = listed["metadata"]["resourceVersion"]
    query = urllib.parse.urlencode(
        {"watch": "true", "timeoutSeconds": "1", "resourceVersion": since}
    )
    with urllib.request.urlopen(f"{base}?{query}", timeout=10) as watch:
        events = [json.loads(line) for line in watch.read().splitlines() if line.strip()]
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "MODIFIED", "DELETED"]
    assert events[1]["object"]["status"] == {"readyToUse": True, "restoreSize": "2Gi"}
    assert events[2]["object"]["metadata"]["labels"] == {"checkpoint": "ck-9"}
    assert events[1]["object"]["metadata"]["generation"] == 1  # status is its own subresource


# ---------------------------------------------------------------------------- restarts


@contextlib.contextmanager
def running(root: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[Stack]:
    """``drainctl dev up`` in ``root`` (with ``extra`` options and ``env`` settings) until
    the block ends."""
    stack = Stack(root, *extra, env=env)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop(60)


def taken_before_a_restart(root: Path, files: dict[str, str]) -> dict[str, Any]:
    """VolumeSnapshot default/ck-1 of PVC ws holding ``files``, taken by a stack in ``root``
    that is stopped again."""
    with running(root) as first:
        first.apply(pvc("ws", "default"))
        first.mounted("default", "ws", files)
        first.apply(volume_snapshot("ck-1", "default", "ws"))
        return first.wait_taken("default", "ck-1")


def test_snapshots_and_their_copies_survive_a_restart_of_dev_up(tmp_path: Path) -> None:
    taken = taken_before_a_restart(tmp_path, {"session.json": "before the restart"})
    with running(tmp_path) as second:
        again = second.wait_taken("default", "ck-1")
        assert again["metadata"]["uid"] == taken["metadata"]["uid"]
        assert (second.copy_of(again) / "session.json").read_text() == "before the restart"
        classes = second.kubectl("get", "volumesnapshotclass", "-o", "name").stdout.split()
        assert classes == [f"volumesnapshotclass.{SNAPSHOT_GROUP}/{DEV_SNAPSHOT_CLASS}"]
        second.apply(pvc("restored", "default", from_snapshot="ck-1"))
        restored = second.volume("default", "restored") / "session.json"
        wait_until(restored.exists, READY_SECS, "the restore after the restart")
        assert restored.read_text() == "before the restart"


NO_SUCH_RESOURCE = 'the server doesn\'t have a resource type "volumesnapshots"'


def test_no_snapshots_serves_a_cluster_without_csi_snapshot_support(tmp_path: Path) -> None:
    with running(tmp_path, "--no-snapshots") as bare:
        listed = bare.kubectl("get", "volumesnapshots", check=False)
        assert listed.returncode != 0
        assert NO_SUCH_RESOURCE in listed.stderr
        assert SNAPSHOT_GROUP not in bare.kubectl("get", "crd", "-o", "name").stdout


def test_no_snapshots_on_a_state_dir_that_had_them_removes_them(tmp_path: Path) -> None:
    taken_before_a_restart(tmp_path, {"a": "1"})
    with running(tmp_path, "--no-snapshots") as bare:
        assert NO_SUCH_RESOURCE in bare.kubectl("get", "volumesnapshots", check=False).stderr
        assert f"crd_removed name={SNAPSHOT_CRD}" in bare.log_text()
        assert (bare.volume("default", "ws") / "a").read_text() == "1"  # volumes are kept


# ------------------------------------------------------------------- a ready delay

READY_DELAY_SECS = 4.0


def test_with_a_ready_delay_a_snapshot_is_cut_at_once_and_ready_only_after_the_delay(
    tmp_path: Path,
) -> None:
    """Tried: ``DRAIN_DEV_SNAPSHOT_READY_DELAY_SECS=4`` (``--snapshot-ready-delay``'s
    variable); a VolumeSnapshot of a written volume, then a PVC restored from it at once.
    As the external-snapshotter reports a real driver's upload: cut (creationTime set,
    bound to its content) with the copy already whole, readyToUse only after the delay;
    the restore waits for ready."""
    env = {"DRAIN_DEV_SNAPSHOT_READY_DELAY_SECS": f"{READY_DELAY_SECS:g}"}
    with running(tmp_path, env=env) as stack:
        stack.apply(pvc("ws", "default"))
        volume = stack.mounted("default", "ws", {"session.json": "turn 1"})
        stack.apply(volume_snapshot("ck-1", "default", "ws"))

        def cut() -> dict[str, Any] | None:
            found = stack.get("volumesnapshot", "ck-1", "default") or {}
            status = found.get("status") or {}
            return found if status.get("boundVolumeSnapshotContentName") else None

        snapshot = wait_until(cut, READY_SECS, "volumesnapshot default/ck-1 to be cut")
        status = snapshot["status"]
        assert status["readyToUse"] is False
        assert status["creationTime"].endswith("Z")
        assert "error" not in status
        content = stack.get("volumesnapshotcontent", status["boundVolumeSnapshotContentName"])
        assert content is not None and content["status"]["readyToUse"] is False
        # The point in time is fixed at the cut: a write after it is not in the snapshot.
        (volume / "session.json").write_text("turn 2")
        assert (stack.copy_of(snapshot) / "session.json").read_text() == "turn 1"
        stack.apply(pvc("restored", "default", from_snapshot="ck-1"))
        restored = stack.volume("default", "restored") / "session.json"
        # Until the delay has passed since the cut: not ready, and nothing restored from it.
        cut_ns = int(content["status"]["creationTime"])
        almost = cut_ns + int((READY_DELAY_SECS - 0.5) * 10**9)
        while time.time_ns() < almost:
            now = stack.get("volumesnapshot", "ck-1", "default") or {}
            assert (now.get("status") or {}).get("readyToUse") is False, now
            assert not restored.exists()
            time.sleep(0.2)

        ready = stack.wait_taken("default", "ck-1")

        assert time.time_ns() - cut_ns >= READY_DELAY_SECS * 10**9
        assert ready["status"]["creationTime"] == status["creationTime"]  # cut once
        readied = stack.get("volumesnapshotcontent", status["boundVolumeSnapshotContentName"])
        assert readied is not None and readied["status"]["readyToUse"] is True
        wait_until(restored.exists, READY_SECS, "the restore once the snapshot is ready")
        assert restored.read_text() == "turn 1"
        assert "readyToUse 4s after the cut" in stack.log_text()
