"""The dev stack's stand-in CSI driver: volumes, their snapshots and their restores, as
directories on this machine.

On a cluster a CSI driver and the external-snapshotter turn a ``snapshot.storage.k8s.io/v1``
VolumeSnapshot of a PVC into a point-in-time copy bound to a VolumeSnapshotContent, and
fill a new PVC whose ``spec.dataSource`` names the snapshot from that copy. In the dev
stack the stand-in Sandbox controller (``sandbox_controller``) maps each PVC to a
directory; :class:`HostPathDriver` is the driver behind that mapping, and the controller
calls it once per poll (level-triggered, like the rest of the stand-in), so the operator
runs the same code against the dev stack as against a cluster:

- layout, under the controller's state dir: a PVC's volume is ``volumes/<ns>/<pvc>``
  (:func:`volume_dir`), a snapshot's copy ``snapshots/<snapshot uid>``
  (:func:`snapshot_dir`; the uid is also the content's ``snapshotHandle``);
- a VolumeSnapshot of a PVC (``spec.source.persistentVolumeClaimName``) whose class is
  this driver's (:data:`DEV_CSI_DRIVER`; the default-annotated class when it names none,
  which is then written into its spec, as the snapshot controller does) gets its copy,
  a VolumeSnapshotContent ``snapcontent-<uid>`` and, as the external-snapshotter writes
  them, ``status.creationTime`` and ``status.boundVolumeSnapshotContentName`` (it is
  *cut*: its point in time is fixed) and ``status.readyToUse: true``. With a ready delay
  (``drainctl dev up --snapshot-ready-delay``, as a real driver uploads a snapshot for
  minutes) it is cut at once and ``readyToUse`` only once the delay has passed since its
  content's ``creationTime`` (:func:`ready_due`); the copy is made at the cut either way.
  A source PVC that is missing or not provisioned yet gets ``status.error`` instead, and
  is tried again on later polls. A class of another driver is left alone;
- a PVC whose ``dataSource`` (or ``dataSourceRef``) is a VolumeSnapshot gets its volume
  filled from the snapshot's copy once the snapshot is ready; until then it has no
  volume and :meth:`HostPathDriver.mount_blocker` keeps pods that mount it waiting;
- a PVC whose volume exists is ``status.phase: Bound``;
- a snapshot gone from the API takes its content (deletion policy ``Delete``) and then
  its copy with it; a ``Retain`` content keeps its copy.

What must stay true: a copy is written into a hidden sibling and renamed into place
(:func:`copy_atomically`), so a snapshot or a restored volume is whole or absent, never
half; a snapshot says ``readyToUse`` only once its copy is in place, and the copy is
never written again (the source PVC changing later does not touch it); a restored
volume is never written by this driver again either (it is the PVC's own copy); copies
are removed only after lists that succeeded, so an API that serves no snapshots
(``drainctl dev up --no-snapshots``) loses none. The decisions (:func:`plan_snapshot`,
:func:`plan_restore`, what to collect) and the objects' builders are pure functions of
the listed objects; :class:`HostPathDriver` only lists, calls them, copies and writes.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import stat
from collections.abc import Iterable, Iterator, Mapping, Set
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.utils.quantity import parse_quantity

from orchestrator.devcluster.patching import MERGE_PATCH
from orchestrator.operator.crd import (
    DEFAULT_SNAPSHOT_CLASS_ANNOTATION,
    SNAPSHOT_API_VERSION,
    SNAPSHOT_CLASS_PLURAL,
    SNAPSHOT_CONTENT_PLURAL,
    SNAPSHOT_GROUP,
    SNAPSHOT_KIND,
    SNAPSHOT_PLURAL,
    SNAPSHOT_VERSION,
)

log = logging.getLogger(__name__)

Obj = dict[str, Any]
ObjectKey = tuple[str, str]  # (namespace, name)

DEV_CSI_DRIVER: Final = "dev.caliban-drain.io/hostpath"
"""The driver name of this stand-in, in its VolumeSnapshotClass and contents."""
DEV_SNAPSHOT_CLASS: Final = "caliban-dev-snapshots"
"""The VolumeSnapshotClass ``drainctl dev up`` creates: this driver's, the default."""
SNAPSHOT_CLASS_KIND: Final = "VolumeSnapshotClass"
SNAPSHOT_CONTENT_KIND: Final = "VolumeSnapshotContent"
CONTENT_NAME_PREFIX: Final = "snapcontent-"
"""A dynamically created content is ``snapcontent-<snapshot uid>``, as the snapshot
controller names it."""
VOLUMES_DIR: Final = "volumes"
SNAPSHOTS_DIR: Final = "snapshots"
PARTIAL_SUFFIX: Final = ".partial"
"""A copy in progress is ``.<name>.partial`` beside its target; any found between polls
is a crashed copy's leftovers."""
BOUND: Final = "Bound"
TAKERS: Final = 8
"""Snapshots converged side by side in one pass."""
DELETE: Final = "Delete"
"""The deletion policy under which a content (and its copy) goes with its snapshot."""


# ------------------------------------------------------------------ layout and copying


def volume_dir(root: Path, namespace: str, claim: str) -> Path:
    """The directory that is PVC ``namespace/claim``'s volume."""
    return root / VOLUMES_DIR / namespace / claim


def snapshot_dir(root: Path, handle: str) -> Path:
    """The copy a snapshot handle (its VolumeSnapshot's uid) names."""
    return root / SNAPSHOTS_DIR / handle


def copy_atomically(source: Path, target: Path) -> None:
    """Copy the tree ``source`` to ``target``: into a hidden sibling first, then renamed
    into place, so ``target`` is whole or absent. A ``target`` that exists is never
    replaced (:class:`FileExistsError`). Symlinks are copied as links, never followed
    out of the volume; sockets, FIFOs and devices (an agent's live control socket) are
    left out: they hold no data, and a block-level snapshot has none to restore either."""
    if target.exists():
        raise FileExistsError(f"{target} exists: a copy never replaces one")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}{PARTIAL_SUFFIX}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        shutil.copytree(source, partial, symlinks=True, ignore=special_files)
        os.rename(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def special_files(directory: str, names: list[str]) -> set[str]:
    """Entries of ``directory`` that are neither files, directories nor symlinks."""
    special = set()
    for name in names:
        try:
            mode = os.lstat(os.path.join(directory, name)).st_mode
        except FileNotFoundError:
            special.add(name)  # gone while copying (a socket unlinked as its agent exits)
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            special.add(name)
    return special


def tree_bytes(root: Path) -> int:
    """The size of the regular files under ``root``."""
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            path = Path(directory, name)
            if not path.is_symlink():
                total += path.stat().st_size
    return total


# ------------------------------------------------------------------ decisions


@dataclass(frozen=True)
class Take:
    """Copy ``claim``'s volume now: the snapshot is this driver's and its source is there."""

    snapshot_class: Obj
    claim: Obj


@dataclass(frozen=True)
class Fail:
    """Why a snapshot cannot be taken (yet): its ``status.error``; tried again later."""

    message: str


@dataclass(frozen=True)
class Waiting:
    """Why a PVC's volume cannot be filled from its snapshot yet."""

    reason: str


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def object_key(obj: Mapping[str, Any]) -> ObjectKey:
    meta = _meta(obj)
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def snapshot_class_of(snapshot: Mapping[str, Any], classes: Iterable[Obj]) -> Obj | Fail | None:
    """The snapshot's class if it is this driver's; None if it is another driver's."""
    named = (snapshot.get("spec") or {}).get("volumeSnapshotClassName")
    if named:
        found = next((c for c in classes if _meta(c).get("name") == named), None)
        if found is None:
            return Fail(f'volumesnapshotclass "{named}" not found')
        return found if found.get("driver") == DEV_CSI_DRIVER else None
    # Unnamed: the default class of the source volume's driver, and every dev volume is ours.
    defaults = [
        c
        for c in classes
        if c.get("driver") == DEV_CSI_DRIVER
        and (_meta(c).get("annotations") or {}).get(DEFAULT_SNAPSHOT_CLASS_ANNOTATION) == "true"
    ]
    if len(defaults) == 1:
        return defaults[0]
    if not defaults:
        return Fail(f"cannot find default snapshot class for driver {DEV_CSI_DRIVER}")
    return Fail(f"{len(defaults)} default snapshot classes were found for driver {DEV_CSI_DRIVER}")


def plan_snapshot(
    snapshot: Mapping[str, Any],
    classes: Iterable[Obj],
    claims: Mapping[ObjectKey, Obj],
    provisioned: Set[ObjectKey],
) -> Take | Fail | None:
    """What to do about ``snapshot`` this poll: take it, report why not, or nothing (it
    is taken, being deleted, pre-provisioned, or another driver's)."""
    if _meta(snapshot).get("deletionTimestamp"):
        return None
    status = snapshot.get("status") or {}
    if status.get("readyToUse") is True or cut(snapshot):
        return None  # taken: immutable from here on
    source = ((snapshot.get("spec") or {}).get("source") or {}).get("persistentVolumeClaimName")
    if not source:
        return None  # bound to a pre-provisioned content: nothing for a driver to copy
    snapshot_class = snapshot_class_of(snapshot, classes)
    if not isinstance(snapshot_class, dict):
        return snapshot_class
    namespace = object_key(snapshot)[0]
    claim = claims.get((namespace, source))
    if claim is None:
        return Fail(f'persistentvolumeclaim "{source}" not found in namespace "{namespace}"')
    if (namespace, source) not in provisioned:
        return Fail(
            f'persistentvolumeclaim "{source}" has no volume yet (no pod has mounted it and '
            "it was not restored from a snapshot)"
        )
    return Take(snapshot_class, claim)


def cut(snapshot: Mapping[str, Any]) -> bool:
    """Whether ``snapshot`` is cut: bound to its content, with its ``creationTime``."""
    status = snapshot.get("status") or {}
    return bool(status.get("boundVolumeSnapshotContentName") and status.get("creationTime"))


def ready_due(
    snapshot: Mapping[str, Any],
    contents: Mapping[str, Obj],
    now: datetime.datetime,
    ready_delay_secs: float,
) -> bool:
    """Whether this driver's cut snapshot is to be made ``readyToUse`` now: its content's
    ``creationTime`` (nanoseconds, exact where the snapshot's is in seconds) is at least
    ``ready_delay_secs`` ago."""
    status = snapshot.get("status") or {}
    if _meta(snapshot).get("deletionTimestamp") or status.get("readyToUse") is True:
        return False
    if not cut(snapshot):
        return False
    content = contents.get(str(status["boundVolumeSnapshotContentName"]))
    if content is None or (content.get("spec") or {}).get("driver") != DEV_CSI_DRIVER:
        return False
    created = (content.get("status") or {}).get("creationTime")
    if not isinstance(created, int):
        return False
    return _nanoseconds(now) - created >= ready_delay_secs * 10**9


def restore_source(claim: Mapping[str, Any]) -> ObjectKey | None:
    """The VolumeSnapshot (namespace, name) a PVC is to be filled from, if any."""
    spec = claim.get("spec") or {}
    for ref in (spec.get("dataSourceRef"), spec.get("dataSource")):
        if (
            isinstance(ref, Mapping)
            and ref.get("kind") == SNAPSHOT_KIND
            and ref.get("apiGroup") == SNAPSHOT_GROUP
            and ref.get("name")
        ):
            return (str(ref.get("namespace") or object_key(claim)[0]), str(ref["name"]))
    return None


def plan_restore(
    source: ObjectKey, snapshots: Mapping[ObjectKey, Obj], contents: Mapping[str, Obj]
) -> str | Waiting:
    """The snapshot handle to fill a PVC's volume from, or why it must wait."""
    shown = f"{source[0]}/{source[1]}"
    snapshot = snapshots.get(source)
    if snapshot is None:
        return Waiting(f"volumesnapshot {shown} not found")
    status = snapshot.get("status") or {}
    if status.get("readyToUse") is not True:
        return Waiting(f"volumesnapshot {shown} is not ready to use")
    content = contents.get(str(status.get("boundVolumeSnapshotContentName") or ""))
    if content is None:
        return Waiting(f"volumesnapshot {shown} is bound to no volumesnapshotcontent")
    if (content.get("spec") or {}).get("driver") != DEV_CSI_DRIVER:
        return Waiting(f"volumesnapshot {shown} is another driver's")
    handle = (content.get("status") or {}).get("snapshotHandle")
    if not handle:
        return Waiting(f"volumesnapshot {shown} has no snapshot handle yet")
    return str(handle)


def contents_to_delete(contents: Iterable[Obj], snapshot_uids: Iterable[str]) -> list[str]:
    """This driver's contents whose snapshot is gone and whose policy is ``Delete``."""
    live = set(snapshot_uids)
    return [
        str(_meta(c).get("name"))
        for c in contents
        if (c.get("spec") or {}).get("driver") == DEV_CSI_DRIVER
        and (c.get("spec") or {}).get("deletionPolicy") == DELETE
        and ((c.get("spec") or {}).get("volumeSnapshotRef") or {}).get("uid") not in live
        and not _meta(c).get("deletionTimestamp")
    ]


def copies_to_keep(snapshot_uids: Iterable[str], contents: Iterable[Obj]) -> set[str]:
    """The copies still wanted: every live snapshot's (taken or about to be) and every
    handle a content of this driver still holds (a ``Retain`` one outlives its snapshot)."""
    keep = set(snapshot_uids)
    for content in contents:
        if (content.get("spec") or {}).get("driver") == DEV_CSI_DRIVER:
            handle = (content.get("status") or {}).get("snapshotHandle")
            if handle:
                keep.add(str(handle))
    return keep


def restore_size(claim: Mapping[str, Any]) -> str | None:
    """The storage a PVC requests (``"1Gi"``), the size a restore from its snapshot needs."""
    requested = ((claim.get("spec") or {}).get("resources") or {}).get("requests") or {}
    storage = requested.get("storage")
    return str(storage) if storage else None


def size_in_bytes(quantity: str | None, copy: Path) -> int:
    """``quantity`` in bytes, or (none, or not a quantity) the size of ``copy``."""
    if quantity is not None:
        with contextlib.suppress(ValueError):  # not a quantity: measured instead
            return int(parse_quantity(quantity))
    return tree_bytes(copy)


def rfc3339(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _nanoseconds(moment: datetime.datetime) -> int:
    return int(moment.timestamp()) * 10**9 + moment.microsecond * 1000


# ------------------------------------------------------------------ builders


def build_snapshot_class() -> Obj:
    """The dev stack's VolumeSnapshotClass: this driver's, the default one."""
    return {
        "apiVersion": SNAPSHOT_API_VERSION,
        "kind": SNAPSHOT_CLASS_KIND,
        "metadata": {
            "name": DEV_SNAPSHOT_CLASS,
            "annotations": {DEFAULT_SNAPSHOT_CLASS_ANNOTATION: "true"},
        },
        "driver": DEV_CSI_DRIVER,
        "deletionPolicy": DELETE,
    }


def content_name(snapshot: Mapping[str, Any]) -> str:
    return f"{CONTENT_NAME_PREFIX}{_meta(snapshot)['uid']}"


def build_content(snapshot: Mapping[str, Any], snapshot_class: Obj, claim: Obj) -> Obj:
    """The VolumeSnapshotContent of a dynamically taken snapshot (status set apart)."""
    meta = _meta(snapshot)
    return {
        "apiVersion": SNAPSHOT_API_VERSION,
        "kind": SNAPSHOT_CONTENT_KIND,
        "metadata": {"name": content_name(snapshot)},
        "spec": {
            "driver": DEV_CSI_DRIVER,
            "deletionPolicy": snapshot_class.get("deletionPolicy", DELETE),
            # The volume's handle is where it lives: <namespace>/<pvc>.
            "source": {"volumeHandle": "/".join(object_key(claim))},
            "volumeSnapshotClassName": _meta(snapshot_class)["name"],
            "volumeSnapshotRef": {
                "apiVersion": SNAPSHOT_API_VERSION,
                "kind": SNAPSHOT_KIND,
                "namespace": meta["namespace"],
                "name": meta["name"],
                "uid": meta["uid"],
            },
        },
    }


def content_status(
    handle: str, size_bytes: int, taken_at: datetime.datetime, *, ready: bool = True
) -> Obj:
    return {
        "snapshotHandle": handle,
        "readyToUse": ready,
        "restoreSize": size_bytes,
        "creationTime": _nanoseconds(taken_at),
    }


def ready_status(
    bound_content: str, taken_at: datetime.datetime, size: str | int, *, ready: bool = True
) -> dict[str, Any]:
    """The VolumeSnapshot's status once taken (a merge patch: ``error`` is cleared): cut,
    and ready unless its readiness is to come later."""
    return {
        "boundVolumeSnapshotContentName": bound_content,
        "creationTime": rfc3339(taken_at),
        "readyToUse": ready,
        "restoreSize": size,
        "error": None,
    }


def error_status(message: str, now: datetime.datetime) -> Obj:
    return {"readyToUse": False, "error": {"message": message, "time": rfc3339(now)}}


def reports(snapshot: Mapping[str, Any], message: str) -> bool:
    """Whether ``snapshot``'s status already says ``message`` (no need to write it again)."""
    status = snapshot.get("status") or {}
    return (
        status.get("readyToUse") is False and (status.get("error") or {}).get("message") == message
    )


# ------------------------------------------------------------------ the API


def _list_custom(plural: str) -> list[Obj] | None:
    """Every object of ``plural`` in ``snapshot.storage.k8s.io/v1``; None if not served."""
    try:
        listed = client.CustomObjectsApi().list_cluster_custom_object(
            SNAPSHOT_GROUP, SNAPSHOT_VERSION, plural
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    items: list[Obj] = listed.get("items", [])
    return items


def list_claims() -> dict[ObjectKey, Obj]:
    """Every PVC, as the API serves it (JSON, not the client's models)."""
    response = client.CoreV1Api().list_persistent_volume_claim_for_all_namespaces(
        _preload_content=False
    )
    items: list[Obj] = json.loads(response.data).get("items") or []
    return {object_key(item): item for item in items}


def read_claim(namespace: str, name: str) -> Obj | None:
    try:
        response = client.CoreV1Api().read_namespaced_persistent_volume_claim(
            name, namespace, _preload_content=False
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    claim: Obj = json.loads(response.data)
    return claim


def ensure_snapshot_class() -> bool:
    """Create :data:`DEV_SNAPSHOT_CLASS`; False if it exists (from a saved API state)."""
    try:
        client.CustomObjectsApi().create_cluster_custom_object(
            SNAPSHOT_GROUP, SNAPSHOT_VERSION, SNAPSHOT_CLASS_PLURAL, build_snapshot_class()
        )
    except ApiException as exc:
        if exc.status == 409:
            return False
        raise
    return True


@contextlib.contextmanager
def _ignoring(*statuses: int) -> Iterator[None]:
    """Swallow an ApiException of ``statuses`` (404: gone since the list; 409: there)."""
    try:
        yield
    except ApiException as exc:
        if exc.status not in statuses:
            raise


# ------------------------------------------------------------------ the driver


class HostPathDriver:
    """See the module. :meth:`converge` runs in a thread, once per poll of the stand-in
    Sandbox controller; :meth:`mount_blocker` before it starts a pod."""

    def __init__(self, root: Path, ready_delay_secs: float = 0.0) -> None:
        self.root = root
        self.ready_delay_secs = ready_delay_secs
        """How long after its cut a snapshot becomes ``readyToUse`` (0: at once)."""
        self._said: dict[str, str] = {}  # what was last logged about an object, said once
        self._takers = ThreadPoolExecutor(TAKERS, thread_name_prefix="csi-take")

    def converge(self) -> None:
        claims = list_claims()
        snapshots = _list_custom(SNAPSHOT_PLURAL)
        classes = _list_custom(SNAPSHOT_CLASS_PLURAL)
        contents = _list_custom(SNAPSHOT_CONTENT_PLURAL)
        if snapshots is not None and classes is not None and contents is not None:
            provisioned = {key for key in claims if volume_dir(self.root, *key).is_dir()}
            by_name = {str(_meta(c).get("name")): c for c in contents}
            # Each snapshot is its own copy and its own objects: taken side by side, so a
            # fan-out of deletions does not wait for its snapshots one API round trip at
            # a time.
            list(
                self._takers.map(
                    lambda snapshot: self._converge_snapshot(
                        snapshot, classes, claims, provisioned, by_name
                    ),
                    snapshots,
                )
            )
            self._collect(snapshots, contents)
        self._restore(claims, snapshots or [], contents or [])
        self._bind(claims)

    def mount_blocker(self, namespace: str, name: str) -> str | None:
        """Why a pod must not mount PVC ``namespace/name`` yet (its volume is still to be
        filled from a snapshot), or None. Read afresh: the PVC may be newer than the poll."""
        if volume_dir(self.root, namespace, name).is_dir():
            return None
        claim = read_claim(namespace, name)
        source = restore_source(claim) if claim is not None else None
        if source is None:
            return None  # an empty volume, made on first mount
        return f"its volume is to be restored from volumesnapshot {source[0]}/{source[1]}"

    # -------------------------------------------------------------- snapshots

    def _converge_snapshot(
        self,
        snapshot: Obj,
        classes: list[Obj],
        claims: Mapping[ObjectKey, Obj],
        provisioned: set[ObjectKey],
        contents: Mapping[str, Obj],
    ) -> None:
        about = _about("vs", object_key(snapshot))
        plan = plan_snapshot(snapshot, classes, claims, provisioned)
        try:
            if isinstance(plan, Fail):
                self._say(about, "snapshot_waiting", plan.message)
                if not reports(snapshot, plan.message):
                    self._patch_snapshot_status(snapshot, error_status(plan.message, _now()))
            elif isinstance(plan, Take):
                self._take(snapshot, plan)
            elif ready_due(snapshot, contents, _now(), self.ready_delay_secs):
                self._make_ready(snapshot)
        except ApiException as exc:
            # 404: gone since the list. Anything else is this snapshot's alone: the
            # others go on, and the next poll tries it again.
            if exc.status != 404:
                self._say(about, "snapshot_write_failed", f"{exc.status} {exc.reason}")

    def _take(self, snapshot: Obj, plan: Take) -> None:
        namespace, name = object_key(snapshot)
        uid = str(_meta(snapshot)["uid"])
        source = volume_dir(self.root, *object_key(plan.claim))
        copy = snapshot_dir(self.root, uid)
        if not copy.is_dir():  # a copy in place is whole: a retry after a crash reuses it
            try:
                copy_atomically(source, copy)
            except OSError as exc:  # a file vanishing under the copy: try again next poll
                message = (
                    f'copying the volume of persistentvolumeclaim "{source.name}" failed '
                    f"(tried again on the next poll): {exc}"
                )
                self._patch_snapshot_status(snapshot, error_status(message, _now()))
                return
        taken_at = _now()
        ready = self.ready_delay_secs <= 0
        class_name = _meta(plan.snapshot_class)["name"]
        if not (snapshot.get("spec") or {}).get("volumeSnapshotClassName"):
            self._patch_snapshot(snapshot, {"spec": {"volumeSnapshotClassName": class_name}})
        requested = restore_size(plan.claim)
        size_bytes = size_in_bytes(requested, copy)
        content = build_content(snapshot, plan.snapshot_class, plan.claim)
        api = client.CustomObjectsApi()
        with _ignoring(409):  # created by an earlier poll that stopped short of the status
            api.create_cluster_custom_object(
                SNAPSHOT_GROUP, SNAPSHOT_VERSION, SNAPSHOT_CONTENT_PLURAL, content
            )
        api.patch_cluster_custom_object_status(
            SNAPSHOT_GROUP,
            SNAPSHOT_VERSION,
            SNAPSHOT_CONTENT_PLURAL,
            content_name(snapshot),
            {"status": content_status(uid, size_bytes, taken_at, ready=ready)},
            _content_type=MERGE_PATCH,
        )
        status = ready_status(
            content_name(snapshot), taken_at, requested or size_bytes, ready=ready
        )
        self._patch_snapshot_status(snapshot, status)
        self._said.pop(_about("vs", (namespace, name)), None)
        log.info(
            "snapshot_taken snapshot=%s/%s pvc=%s class=%s copy=%s ready=%s",
            namespace,
            name,
            source.name,
            class_name,
            copy,
            "now" if ready else f"in {self.ready_delay_secs:g}s",
        )

    def _make_ready(self, snapshot: Obj) -> None:
        """A cut snapshot whose ready delay has passed: its content, then it, readyToUse
        (in that order, as the external-snapshotter reports a content's readiness)."""
        bound = str((snapshot.get("status") or {})["boundVolumeSnapshotContentName"])
        client.CustomObjectsApi().patch_cluster_custom_object_status(
            SNAPSHOT_GROUP,
            SNAPSHOT_VERSION,
            SNAPSHOT_CONTENT_PLURAL,
            bound,
            {"status": {"readyToUse": True}},
            _content_type=MERGE_PATCH,
        )
        self._patch_snapshot_status(snapshot, {"readyToUse": True})
        namespace, name = object_key(snapshot)
        log.info("snapshot_ready snapshot=%s/%s content=%s", namespace, name, bound)

    @staticmethod
    def _patch_snapshot(snapshot: Obj, patch: Obj) -> None:
        namespace, name = object_key(snapshot)
        client.CustomObjectsApi().patch_namespaced_custom_object(
            SNAPSHOT_GROUP,
            SNAPSHOT_VERSION,
            namespace,
            SNAPSHOT_PLURAL,
            name,
            patch,
            _content_type=MERGE_PATCH,
        )

    @staticmethod
    def _patch_snapshot_status(snapshot: Obj, status: Obj) -> None:
        namespace, name = object_key(snapshot)
        client.CustomObjectsApi().patch_namespaced_custom_object_status(
            SNAPSHOT_GROUP,
            SNAPSHOT_VERSION,
            namespace,
            SNAPSHOT_PLURAL,
            name,
            {"status": status},
            _content_type=MERGE_PATCH,
        )

    def _collect(self, snapshots: list[Obj], contents: list[Obj]) -> None:
        """Contents and then copies whose snapshot is gone (see :func:`contents_to_delete`
        and :func:`copies_to_keep`), and leftovers of crashed copies."""
        uids = [str(_meta(s).get("uid")) for s in snapshots]
        gone = set(contents_to_delete(contents, uids))
        for name in sorted(gone):
            with _ignoring(404):
                client.CustomObjectsApi().delete_cluster_custom_object(
                    SNAPSHOT_GROUP, SNAPSHOT_VERSION, SNAPSHOT_CONTENT_PLURAL, name
                )
            log.info("snapshot_content_deleted content=%s reason=snapshot-gone", name)
        kept = copies_to_keep(uids, [c for c in contents if _meta(c).get("name") not in gone])
        root = self.root / SNAPSHOTS_DIR
        if not root.is_dir():
            return
        for copy in root.iterdir():
            if copy.name not in kept:
                log.info("snapshot_copy_removed copy=%s", copy)
                shutil.rmtree(copy, ignore_errors=True)

    # -------------------------------------------------------------- restores

    def _restore(
        self, claims: Mapping[ObjectKey, Obj], snapshots: list[Obj], contents: list[Obj]
    ) -> None:
        by_key = {object_key(s): s for s in snapshots}
        by_name = {str(_meta(c).get("name")): c for c in contents}
        for key, claim in claims.items():
            source = restore_source(claim)
            target = volume_dir(self.root, *key)
            if source is None or target.is_dir() or _meta(claim).get("deletionTimestamp"):
                continue
            plan = plan_restore(source, by_key, by_name)
            if isinstance(plan, str) and not snapshot_dir(self.root, plan).is_dir():
                plan = Waiting(f"the copy of volumesnapshot {source[0]}/{source[1]} is missing")
            if isinstance(plan, Waiting):
                self._say(_about("pvc", key), "volume_restore_waiting", plan.reason)
                continue
            try:
                copy_atomically(snapshot_dir(self.root, plan), target)
            except OSError as exc:
                self._say(_about("pvc", key), "volume_restore_failed", str(exc))
                continue
            self._said.pop(_about("pvc", key), None)
            log.info(
                "volume_restored pvc=%s/%s snapshot=%s/%s", key[0], key[1], source[0], source[1]
            )

    def _bind(self, claims: Mapping[ObjectKey, Obj]) -> None:
        """``status.phase: Bound`` for every PVC whose volume exists."""
        for (namespace, name), claim in claims.items():
            status = claim.get("status") or {}
            if status.get("phase") == BOUND or not volume_dir(self.root, namespace, name).is_dir():
                continue
            spec = claim.get("spec") or {}
            bound: Obj = {"phase": BOUND, "accessModes": spec.get("accessModes") or []}
            if size := restore_size(claim):
                bound["capacity"] = {"storage": size}
            with _ignoring(404):
                client.CoreV1Api().patch_namespaced_persistent_volume_claim_status(
                    name, namespace, {"status": bound}, _content_type=MERGE_PATCH
                )

    def _say(self, about: str, event: str, message: str) -> None:
        """Log ``event`` about an object once per distinct message."""
        if self._said.get(about) != message:
            self._said[about] = message
            log.info("%s object=%s reason=%r", event, about, message)


def _about(kind: str, key: ObjectKey) -> str:
    return f"{kind}/{key[0]}/{key[1]}"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
