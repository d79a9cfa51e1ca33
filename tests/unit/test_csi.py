"""The stand-in CSI driver's decisions and builders (``orchestrator.devcluster.csi``),
without an API: which snapshots it takes, what it reports, what a restore waits for,
what it collects, the objects it writes, and copies that are whole or absent."""

from __future__ import annotations

import datetime
import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from orchestrator.devcluster import csi
from orchestrator.operator.crd import DEFAULT_SNAPSHOT_CLASS_ANNOTATION

OURS: dict[str, Any] = {
    "metadata": {"name": "dev", "annotations": {DEFAULT_SNAPSHOT_CLASS_ANNOTATION: "true"}},
    "driver": "dev.caliban-drain.io/hostpath",
    "deletionPolicy": "Delete",
}
OURS_NOT_DEFAULT: dict[str, Any] = {
    "metadata": {"name": "dev-retain"},
    "driver": "dev.caliban-drain.io/hostpath",
    "deletionPolicy": "Retain",
}
THEIRS: dict[str, Any] = {
    "metadata": {"name": "ebs", "annotations": {DEFAULT_SNAPSHOT_CLASS_ANNOTATION: "true"}},
    "driver": "ebs.csi.aws.com",
    "deletionPolicy": "Delete",
}
CLAIM: dict[str, Any] = {
    "metadata": {"namespace": "team", "name": "ws", "uid": "pvc-uid"},
    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
}
CLAIMS = {("team", "ws"): CLAIM}
MOMENT = datetime.datetime(2025, 3, 4, 5, 6, 7, 890000, tzinfo=datetime.UTC)


def snapshot(
    source: str | None = "ws", class_name: str | None = None, **status: Any
) -> dict[str, Any]:
    spec: dict[str, Any] = {"source": {"persistentVolumeClaimName": source} if source else
                            {"volumeSnapshotContentName": "pre-provisioned"}}  # fmt: skip
    if class_name is not None:
        spec["volumeSnapshotClassName"] = class_name
    body: dict[str, Any] = {
        "metadata": {"namespace": "team", "name": "ck-1", "uid": "vs-uid"},
        "spec": spec,
    }
    if status:
        body["status"] = status
    return body


# ------------------------------------------------------------------ taking snapshots


@pytest.mark.parametrize(
    ("case", "classes", "provisioned", "expected"),
    [
        (snapshot(), [OURS, THEIRS], {("team", "ws")}, csi.Take(OURS, CLAIM)),
        (snapshot(class_name="dev-retain"), [OURS, OURS_NOT_DEFAULT], {("team", "ws")},
         csi.Take(OURS_NOT_DEFAULT, CLAIM)),
        (snapshot(class_name="ebs"), [OURS, THEIRS], {("team", "ws")}, None),
        (snapshot(readyToUse=True), [OURS], {("team", "ws")}, None),
        (snapshot(source=None), [OURS], {("team", "ws")}, None),
        (snapshot(class_name="gone"), [OURS], {("team", "ws")},
         csi.Fail('volumesnapshotclass "gone" not found')),
        (snapshot(), [THEIRS], {("team", "ws")},
         csi.Fail("cannot find default snapshot class for driver dev.caliban-drain.io/hostpath")),
        (snapshot(), [OURS, {**OURS, "metadata": {**OURS["metadata"], "name": "dev2"}}],
         {("team", "ws")},
         csi.Fail("2 default snapshot classes were found for driver "
                  "dev.caliban-drain.io/hostpath")),
        (snapshot(source="missing"), [OURS], {("team", "ws")},
         csi.Fail('persistentvolumeclaim "missing" not found in namespace "team"')),
        (snapshot(), [OURS], set(),
         csi.Fail('persistentvolumeclaim "ws" has no volume yet (no pod has mounted it and it '
                  "was not restored from a snapshot)")),
    ],
    ids=[
        "unnamed-class-takes-the-default-of-this-driver",
        "a-named-class-of-this-driver",
        "another-drivers-class-is-left-alone",
        "a-ready-snapshot-is-never-taken-again",
        "a-pre-provisioned-snapshot-has-nothing-to-copy",
        "a-missing-class-is-reported",
        "no-default-class-of-this-driver-is-reported",
        "two-default-classes-are-reported",
        "a-missing-source-pvc-is-reported",
        "a-pvc-without-a-volume-yet-is-reported",
    ],
)  # fmt: skip
def test_plan_snapshot_takes_this_drivers_snapshots_and_says_why_not(
    case: dict[str, Any],
    classes: list[dict[str, Any]],
    provisioned: set[tuple[str, str]],
    expected: csi.Take | csi.Fail | None,
) -> None:
    assert csi.plan_snapshot(case, classes, CLAIMS, provisioned) == expected


def test_a_snapshot_being_deleted_is_not_taken() -> None:
    deleted = snapshot()
    deleted["metadata"]["deletionTimestamp"] = "2025-03-04T05:06:07Z"
    assert csi.plan_snapshot(deleted, [OURS], CLAIMS, {("team", "ws")}) is None


def test_an_error_already_reported_is_not_written_again() -> None:
    reported = snapshot(readyToUse=False, error={"message": "no pvc", "time": "t"})
    assert csi.reports(reported, "no pvc")
    assert not csi.reports(reported, "another reason")
    assert not csi.reports(snapshot(), "no pvc")


def test_the_content_of_a_taken_snapshot_is_pinned() -> None:
    assert csi.build_content(snapshot(), OURS, CLAIM) == {
        "apiVersion": "snapshot.storage.k8s.io/v1",
        "kind": "VolumeSnapshotContent",
        "metadata": {"name": "snapcontent-vs-uid"},
        "spec": {
            "driver": "dev.caliban-drain.io/hostpath",
            "deletionPolicy": "Delete",
            "source": {"volumeHandle": "team/ws"},
            "volumeSnapshotClassName": "dev",
            "volumeSnapshotRef": {
                "apiVersion": "snapshot.storage.k8s.io/v1",
                "kind": "VolumeSnapshot",
                "namespace": "team",
                "name": "ck-1",
                "uid": "vs-uid",
            },
        },
    }
    assert csi.content_status("vs-uid", 1073741824, MOMENT) == {
        "snapshotHandle": "vs-uid",
        "readyToUse": True,
        "restoreSize": 1073741824,
        "creationTime": 1741064767890000000,
    }


def test_a_taken_snapshots_status_names_its_content_and_clears_the_error() -> None:
    assert csi.ready_status("snapcontent-vs-uid", MOMENT, "1Gi") == {
        "boundVolumeSnapshotContentName": "snapcontent-vs-uid",
        "creationTime": "2025-03-04T05:06:07Z",
        "readyToUse": True,
        "restoreSize": "1Gi",
        "error": None,
    }
    assert csi.error_status("no pvc", MOMENT) == {
        "readyToUse": False,
        "error": {"message": "no pvc", "time": "2025-03-04T05:06:07Z"},
    }


def test_the_dev_snapshot_class_is_this_drivers_default() -> None:
    assert csi.build_snapshot_class() == {
        "apiVersion": "snapshot.storage.k8s.io/v1",
        "kind": "VolumeSnapshotClass",
        "metadata": {
            "name": "caliban-dev-snapshots",
            "annotations": {"snapshot.storage.kubernetes.io/is-default-class": "true"},
        },
        "driver": "dev.caliban-drain.io/hostpath",
        "deletionPolicy": "Delete",
    }


@pytest.mark.parametrize(
    ("requested", "files", "expected"),
    [("1Gi", {}, 1073741824), ("500M", {}, 500000000), (None, {"a": 3, "b/c": 4}, 7),
     ("lots", {"a": 5}, 5)],
    ids=["binary-suffix", "decimal-suffix", "no-request-the-copy-size", "not-a-quantity"],
)  # fmt: skip
def test_the_restore_size_in_bytes_is_the_request_or_else_the_copy(
    tmp_path: Path, requested: str | None, files: dict[str, int], expected: int
) -> None:
    for name, size in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)
    assert csi.size_in_bytes(requested, tmp_path) == expected


def test_a_cut_snapshot_is_never_taken_again_while_its_readiness_is_due() -> None:
    """Tried: a snapshot bound to its content with its creationTime and not ready (a ready
    delay): its copy is in place, so it is not taken again, whatever the delay."""
    cut = snapshot(readyToUse=False, creationTime="2025-03-04T05:06:07Z",
                   boundVolumeSnapshotContentName="snapcontent-vs-uid")  # fmt: skip
    assert csi.cut(cut)
    assert csi.plan_snapshot(cut, [OURS], CLAIMS, {("team", "ws")}) is None
    bound_only = snapshot(readyToUse=False, boundVolumeSnapshotContentName="snapcontent-vs-uid")
    assert not csi.cut(bound_only)
    assert csi.plan_snapshot(bound_only, [OURS], CLAIMS, {("team", "ws")}) == csi.Take(OURS, CLAIM)


def test_with_a_ready_delay_a_snapshot_is_cut_at_once_and_ready_later() -> None:
    """What the driver writes at the cut with a ready delay: bound, creationTime, not
    ready, on the snapshot and its content alike."""
    assert csi.ready_status("snapcontent-vs-uid", MOMENT, "1Gi", ready=False) == {
        "boundVolumeSnapshotContentName": "snapcontent-vs-uid",
        "creationTime": "2025-03-04T05:06:07Z",
        "readyToUse": False,
        "restoreSize": "1Gi",
        "error": None,
    }
    assert csi.content_status("vs-uid", 1073741824, MOMENT, ready=False) == {
        "snapshotHandle": "vs-uid",
        "readyToUse": False,
        "restoreSize": 1073741824,
        "creationTime": 1741064767890000000,
    }


CUT_SNAPSHOT = snapshot(readyToUse=False, creationTime="2025-03-04T05:06:07Z",
                        boundVolumeSnapshotContentName="snapcontent-vs-uid")  # fmt: skip
CUT_CONTENT = {"metadata": {"name": "snapcontent-vs-uid"},
               "spec": {"driver": "dev.caliban-drain.io/hostpath"},
               "status": {"snapshotHandle": "vs-uid", "readyToUse": False,
                          "creationTime": 1741064767890000000}}  # fmt: skip


@pytest.mark.parametrize(
    ("case", "contents", "after_secs", "due"),
    [
        (CUT_SNAPSHOT, {"snapcontent-vs-uid": CUT_CONTENT}, 59.999, False),
        (CUT_SNAPSHOT, {"snapcontent-vs-uid": CUT_CONTENT}, 60.0, True),
        ({**CUT_SNAPSHOT, "status": {**CUT_SNAPSHOT["status"], "readyToUse": True}},
         {"snapcontent-vs-uid": CUT_CONTENT}, 120.0, False),
        (snapshot(readyToUse=False), {"snapcontent-vs-uid": CUT_CONTENT}, 120.0, False),
        (CUT_SNAPSHOT, {}, 120.0, False),
        (CUT_SNAPSHOT, {"snapcontent-vs-uid": {**CUT_CONTENT,
                                               "spec": {"driver": "ebs.csi.aws.com"}}},
         120.0, False),
        ({**CUT_SNAPSHOT, "metadata": {**CUT_SNAPSHOT["metadata"],
                                       "deletionTimestamp": "2025-03-04T05:06:30Z"}},
         {"snapcontent-vs-uid": CUT_CONTENT}, 120.0, False),
    ],
    ids=["before-the-delay", "at-the-delay", "ready-already", "not-cut", "no-content",
         "another-drivers-content", "being-deleted"],
)  # fmt: skip
def test_a_cut_snapshot_becomes_ready_once_the_delay_has_passed_since_its_contents_cut(
    case: dict[str, Any], contents: dict[str, Any], after_secs: float, due: bool
) -> None:
    now = MOMENT + datetime.timedelta(seconds=after_secs)
    assert csi.ready_due(case, contents, now, 60.0) is due


# ------------------------------------------------------------------ restores


def claim_with(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": "team", "name": "restored"}, "spec": spec}


SNAPSHOT_REF = {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "ck-1"}


@pytest.mark.parametrize(
    ("claim", "expected"),
    [
        (claim_with(dataSource=SNAPSHOT_REF), ("team", "ck-1")),
        (claim_with(dataSourceRef=SNAPSHOT_REF), ("team", "ck-1")),
        (claim_with(dataSourceRef={**SNAPSHOT_REF, "namespace": "other"}), ("other", "ck-1")),
        (claim_with(dataSource={"kind": "PersistentVolumeClaim", "name": "ws"}), None),
        (claim_with(dataSource={**SNAPSHOT_REF, "apiGroup": "example.com"}), None),
        (claim_with(), None),
    ],
    ids=["data-source", "data-source-ref", "data-source-ref-in-another-namespace",
         "a-pvc-clone-is-not-a-snapshot", "another-group", "none"],
)  # fmt: skip
def test_restore_source_is_the_volumesnapshot_a_pvc_names(
    claim: dict[str, Any], expected: tuple[str, str] | None
) -> None:
    assert csi.restore_source(claim) == expected


READY = snapshot(readyToUse=True, boundVolumeSnapshotContentName="snapcontent-vs-uid")
CONTENT = {"metadata": {"name": "snapcontent-vs-uid"},
           "spec": {"driver": "dev.caliban-drain.io/hostpath"},
           "status": {"snapshotHandle": "vs-uid"}}  # fmt: skip


@pytest.mark.parametrize(
    ("snapshots", "contents", "expected"),
    [
        ({("team", "ck-1"): READY}, {"snapcontent-vs-uid": CONTENT}, "vs-uid"),
        ({}, {}, csi.Waiting("volumesnapshot team/ck-1 not found")),
        ({("team", "ck-1"): snapshot()}, {},
         csi.Waiting("volumesnapshot team/ck-1 is not ready to use")),
        ({("team", "ck-1"): READY}, {},
         csi.Waiting("volumesnapshot team/ck-1 is bound to no volumesnapshotcontent")),
        ({("team", "ck-1"): READY},
         {"snapcontent-vs-uid": {**CONTENT, "spec": {"driver": "ebs.csi.aws.com"}}},
         csi.Waiting("volumesnapshot team/ck-1 is another driver's")),
    ],
    ids=["ready", "missing", "not-ready", "no-content", "another-driver"],
)  # fmt: skip
def test_plan_restore_fills_from_a_ready_snapshot_of_this_driver_only(
    snapshots: dict[tuple[str, str], dict[str, Any]],
    contents: dict[str, dict[str, Any]],
    expected: str | csi.Waiting,
) -> None:
    assert csi.plan_restore(("team", "ck-1"), snapshots, contents) == expected


# ------------------------------------------------------------------ collecting


def content(name: str, snapshot_uid: str, policy: str = "Delete", **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, **extra},
        "spec": {"driver": "dev.caliban-drain.io/hostpath", "deletionPolicy": policy,
                 "volumeSnapshotRef": {"uid": snapshot_uid}},
        "status": {"snapshotHandle": snapshot_uid},
    }  # fmt: skip


def test_a_gone_snapshots_content_goes_unless_retained_or_another_drivers() -> None:
    contents = [
        content("live", "uid-live"),
        content("gone", "uid-gone"),
        content("retained", "uid-retained", policy="Retain"),
        {**content("ebs", "uid-ebs"), "spec": {"driver": "ebs.csi.aws.com",
                                               "deletionPolicy": "Delete"}},
        content("going", "uid-going", deletionTimestamp="2025-03-04T05:06:07Z"),
    ]  # fmt: skip
    assert csi.contents_to_delete(contents, ["uid-live"]) == ["gone"]


def test_copies_kept_are_live_snapshots_and_handles_of_this_drivers_contents() -> None:
    contents = [content("retained", "uid-retained", policy="Retain"),
                {**content("ebs", "uid-ebs"), "spec": {"driver": "ebs.csi.aws.com"}}]  # fmt: skip
    assert csi.copies_to_keep(["uid-live"], contents) == {"uid-live", "uid-retained"}


# ------------------------------------------------------------------ copies


def test_a_copy_is_whole_and_independent_of_its_source(tmp_path: Path) -> None:
    source = tmp_path / "volume"
    (source / "agents" / "a1").mkdir(parents=True)
    (source / "agents" / "a1" / "session.json").write_text("v1")
    (source / "link").symlink_to("/etc/hostname")
    target = tmp_path / "snapshots" / "uid"
    csi.copy_atomically(source, target)
    (source / "agents" / "a1" / "session.json").write_text("v2")
    assert (target / "agents" / "a1" / "session.json").read_text() == "v1"
    assert (target / "link").is_symlink()  # copied as a link, never followed
    assert sorted(p.name for p in target.parent.iterdir()) == ["uid"]


def test_a_copy_that_fails_half_way_leaves_neither_target_nor_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tried: the disk fills (ENOSPC) on the third file of a snapshot's copy."""
    source = tmp_path / "volume"
    source.mkdir()
    for name in ("a", "b", "c"):
        (source / name).write_text(name)
    real_copy = shutil.copyfile

    def disk_full_on_c(src: str, dst: str, **kwargs: bool) -> object:
        if os.path.basename(src) == "c":
            raise OSError(errno.ENOSPC, "No space left on device", dst)
        return real_copy(src, dst, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", disk_full_on_c)
    target = tmp_path / "snapshots" / "uid"
    with pytest.raises(shutil.Error, match="No space left on device"):
        csi.copy_atomically(source, target)
    assert list(target.parent.iterdir()) == []


def test_a_copy_never_replaces_a_target_that_exists(tmp_path: Path) -> None:
    source = tmp_path / "volume"
    source.mkdir()
    (source / "file").write_text("new")
    target = tmp_path / "restored"
    target.mkdir()  # even an empty one, which a rename would silently replace
    with pytest.raises(FileExistsError, match="a copy never replaces one"):
        csi.copy_atomically(source, target)
    assert list(target.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["restored", "volume"]


def test_a_copy_leaves_out_a_live_unix_socket_and_keeps_the_files_beside_it(
    tmp_path: Path,
) -> None:
    """Tried: a volume whose agent directory holds the agent's live control socket (as
    a running agent's does), snapshotted: copytree alone fails on the socket."""
    import socket

    source = tmp_path / "volume"
    agent = source / "agents" / "agent-1"
    agent.mkdir(parents=True)
    (agent / "session.json").write_text('{"turns": 3}')
    listening = socket.socket(socket.AF_UNIX)
    try:
        listening.bind(str(agent / "agent.sock"))
        os.mkfifo(agent / "pipe")
        target = tmp_path / "copy"
        csi.copy_atomically(source, target)
    finally:
        listening.close()
    copied = target / "agents" / "agent-1"
    assert sorted(p.name for p in copied.iterdir()) == ["session.json"]
    assert (copied / "session.json").read_text() == '{"turns": 3}'
