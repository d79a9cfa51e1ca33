"""The external-snapshotter's CRDs as the embedded API reads them, without a server: the
package data is the upstream files, unchanged; each CRD serves the endpoints a cluster
serves (v1 only, the scope, the status subresource, the printer columns); and their
schemas prune and validate objects as a cluster does (their CEL rules,
``x-kubernetes-validations``, are evaluated too: ``tests/unit/test_devcluster_cel.py``)."""

from __future__ import annotations

import functools
import hashlib
from importlib import resources as package_files
from typing import Any

import pytest

from orchestrator.devcluster import resources, schema
from orchestrator.devcluster.up import PACKAGED_CRDS, SNAPSHOT_CRDS, packaged_crds

UPSTREAM_SHA256 = {
    "crds/snapshots/snapshot.storage.k8s.io_volumesnapshots.yaml":
        "b032116e987fb1d7d93cec7d942833adeb9d95c9bdc7e00c10b280c2fe4a6c33",
    "crds/snapshots/snapshot.storage.k8s.io_volumesnapshotclasses.yaml":
        "75e6565aac2c0f2949ed13ea884bbaa388cb7be576b558b709cf1168e011828d",
    "crds/snapshots/snapshot.storage.k8s.io_volumesnapshotcontents.yaml":
        "895a3c1e73b60f06a0deb566dd123d01bdf1b2efc5d5ff5231ff8bbcf42dafc7",
}  # fmt: skip
"""The files of kubernetes-csi/external-snapshotter at the commit its README names;
a new copy comes with a new commit there and new digests here."""


def test_the_snapshot_crds_are_the_upstream_files_unchanged() -> None:
    found = {
        name: hashlib.sha256(package_files.files(package).joinpath(name).read_bytes()).hexdigest()
        for package, name in SNAPSHOT_CRDS
    }
    assert found == UPSTREAM_SHA256


def test_the_snapshot_crds_are_served_unless_switched_off() -> None:
    names = [crd["metadata"]["name"] for crd in packaged_crds()]
    assert names == [
        "calibantasks.caliban.caliban-ai.dev",
        "workspaces.caliban.caliban-ai.dev",
        "sandboxes.agents.x-k8s.io",
        "volumesnapshots.snapshot.storage.k8s.io",
        "volumesnapshotclasses.snapshot.storage.k8s.io",
        "volumesnapshotcontents.snapshot.storage.k8s.io",
    ]
    assert len(packaged_crds(snapshots=False)) == len(PACKAGED_CRDS) == 3


@functools.cache
def served() -> dict[str, resources.ServedResource]:
    """Plural → the one endpoint each snapshot CRD serves."""
    endpoints = {}
    for crd in packaged_crds()[len(PACKAGED_CRDS) :]:
        (endpoint,) = resources.served_from_crd(crd)  # v1beta1 is not served
        endpoints[endpoint.plural] = endpoint
    return endpoints


@pytest.mark.parametrize(
    ("plural", "kind", "namespaced", "short_names", "status"),
    [
        ("volumesnapshots", "VolumeSnapshot", True, ("vs",), True),
        ("volumesnapshotclasses", "VolumeSnapshotClass", False, ("vsclass", "vsclasses"), False),
        ("volumesnapshotcontents", "VolumeSnapshotContent", False, ("vsc", "vscs"), True),
    ],
    ids=["snapshots", "classes", "contents"],
)
def test_each_snapshot_crd_serves_v1_with_its_scope_names_and_status(
    plural: str, kind: str, namespaced: bool, short_names: tuple[str, ...], status: bool
) -> None:
    endpoint = served()[plural]
    assert (endpoint.api_version, endpoint.kind) == ("snapshot.storage.k8s.io/v1", kind)
    assert endpoint.namespaced is namespaced
    assert endpoint.short_names == short_names
    assert endpoint.status_subresource is status
    assert endpoint.storage is None  # v1 is the storage version


def test_kubectl_get_volumesnapshot_has_the_upstream_printer_columns() -> None:
    columns = [(c.name, c.type, c.json_path) for c in served()["volumesnapshots"].columns]
    assert columns == [
        ("ReadyToUse", "boolean", ".status.readyToUse"),
        ("SourcePVC", "string", ".spec.source.persistentVolumeClaimName"),
        ("SourceSnapshotContent", "string", ".spec.source.volumeSnapshotContentName"),
        ("RestoreSize", "string", ".status.restoreSize"),
        ("SnapshotClass", "string", ".spec.volumeSnapshotClassName"),
        ("SnapshotContent", "string", ".status.boundVolumeSnapshotContentName"),
        ("CreationTime", "date", ".status.creationTime"),
        ("Age", "date", ".metadata.creationTimestamp"),
    ]


def errors_of(plural: str, obj: dict[str, Any]) -> list[str]:
    schema_of = served()[plural].schema
    assert schema_of is not None
    pruned, _ = schema.prune_and_default(obj, schema_of)
    return [e.message for e in schema.validate(pruned, schema_of)]


SNAPSHOT: dict[str, Any] = {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
            "metadata": {"name": "ck-1", "namespace": "team"},
            "spec": {"source": {"persistentVolumeClaimName": "ws"}}}  # fmt: skip


@pytest.mark.parametrize(
    ("plural", "obj", "expected"),
    [
        ("volumesnapshots", {**SNAPSHOT, "status": {
            "readyToUse": True, "restoreSize": "1Gi", "creationTime": "2025-03-04T05:06:07Z",
            "boundVolumeSnapshotContentName": "snapcontent-uid"}}, []),
        ("volumesnapshots", {**SNAPSHOT, "status": {"restoreSize": 1073741824}}, []),
        ("volumesnapshots", {**SNAPSHOT, "status": {"readyToUse": False, "error": {
            "message": "no pvc", "time": "2025-03-04T05:06:07Z"}}}, []),
        ("volumesnapshots", {**SNAPSHOT, "status": {"restoreSize": "1Gibberish"}},
         ["status.restoreSize: Invalid value: \"1Gibberish\": status.restoreSize in body "
          "should match '^(\\+|-)?(([0-9]+(\\.[0-9]*)?)|(\\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
          "([eE](\\+|-)?(([0-9]+(\\.[0-9]*)?)|(\\.[0-9]+))))?$'"]),
        ("volumesnapshots", {**SNAPSHOT, "status": {"creationTime": "yesterday"}},
         ['status.creationTime: Invalid value: "yesterday": status.creationTime in body must '
          'be of type date-time: "yesterday"']),
        ("volumesnapshots", {k: v for k, v in SNAPSHOT.items() if k != "spec"},
         ["spec: Required value"]),
        ("volumesnapshotclasses", {"metadata": {"name": "c"}, "driver": "d",
                                   "deletionPolicy": "Maybe"},
         ['deletionPolicy: Unsupported value: "Maybe": supported values: "Delete", "Retain"']),
        ("volumesnapshotclasses", {"metadata": {"name": "c"}, "deletionPolicy": "Delete"},
         ["driver: Required value"]),
        ("volumesnapshotcontents", {
            "metadata": {"name": "snapcontent-uid"},
            "spec": {"driver": "d", "deletionPolicy": "Delete", "source": {"volumeHandle": "h"},
                     "volumeSnapshotRef": {"name": "ck-1", "namespace": "team", "uid": "u"}},
            "status": {"readyToUse": True, "restoreSize": 1073741824,
                       "creationTime": 1741064767890000000, "snapshotHandle": "u"}}, []),
    ],
    ids=["ready-snapshot", "integer-restore-size", "error", "restore-size-not-a-quantity",
         "creation-time-not-a-date", "no-spec", "unknown-deletion-policy", "class-without-driver",
         "ready-content"],
)  # fmt: skip
def test_the_snapshot_schemas_validate_as_a_cluster_does(
    plural: str, obj: dict[str, Any], expected: list[str]
) -> None:
    assert errors_of(plural, obj) == expected


def test_fields_the_schema_does_not_declare_are_pruned() -> None:
    schema_of = served()["volumesnapshots"].schema
    assert schema_of is not None
    body = {**SNAPSHOT, "spec": {**SNAPSHOT["spec"], "colour": "blue"}}
    pruned, unknown = schema.prune_and_default(body, schema_of)
    assert pruned["spec"] == {"source": {"persistentVolumeClaimName": "ws"}}
    assert unknown == ["spec.colour"]
