"""The state of the embedded Kubernetes API and the rules a real API server applies to it.

This is what kubectl and kopf depend on beyond "a dict per object": server-owned
metadata (``uid``, ``creationTimestamp``, ``generation`` bumped by spec changes only, and
``resourceVersion`` from one cluster-wide counter, with 409 on a stale one); the
``status`` subresource (writes to it change only ``.status``; writes to the object leave
``.status`` alone); graceful deletion (an object with finalizers only gets a
``deletionTimestamp`` and goes when its last finalizer is removed); garbage collection by
``ownerReferences`` (a dependent goes with its owner unless the reference was dropped
first, which is how a PVC is retained; ``Orphan`` keeps dependents, and ``Foreground``
is treated as ``Background``); namespaces and CRDs that empty themselves before
they go; CRD schemas; field ownership (``metadata.managedFields`` recorded for every
write, server-side apply with its conflicts: ``managed_fields``); and a log of watch
events so a watch can resume from the ``resourceVersion`` of a list.

Objects live in kmock's :class:`kmock.ObjectsArray` (the emulator's ``objects``), keyed
by their storage resource, so kmock's assertions (``objects[res, ns, name].history``)
keep working; the log replaces kmock's per-resource bus, which only streams events put
after a reader attaches and so cannot replay from a ``resourceVersion``. Everything here
is synchronous and runs on the event loop, so a request sees and makes one consistent
change; only the watch iterator awaits. ``emulator`` maps HTTP onto these methods.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import copy
import datetime
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kmock

from orchestrator.devcluster import (
    cel,
    conversion,
    errors,
    managed_fields,
    patching,
    resources,
    schema,
    selectors,
)
from orchestrator.devcluster.resources import ResourceKey, ServedResource
from worker_agent.k8s_names import is_dns_label, is_dns_subdomain

log = logging.getLogger(__name__)

Obj = dict[str, Any]
StoredKey = tuple[kmock.resource, str | None, str]

PROPAGATION_POLICIES = ("Background", "Foreground", "Orphan")
_NAME_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


@dataclass(frozen=True)
class Snapshot:
    """Everything a restarted API server needs to go on where this one stopped: the live
    objects in storage form (keyed by their storage resource), the resourceVersion
    counter, and the propagation policy of each deletion still waiting for finalizers.
    The watch log is deliberately not part of it: a watch from before a restore gets 410
    Expired and lists again, as after a real server's compaction."""

    resource_version: int
    objects: list[tuple[ResourceKey, Obj]]
    deletion_policies: dict[str, str]


class SnapshotError(ValueError):
    """A snapshot cannot be restored (an object of a resource nothing serves, a CRD that
    no longer registers); the message names the object."""


@dataclass(frozen=True)
class Writer:
    """Who makes a write, as ``metadata.managedFields`` records it: the field manager
    (the ``fieldManager`` parameter, or the User-Agent's product), and for server-side
    apply whether it takes fields other managers own (``force``)."""

    manager: str
    force: bool = False


SERVER = Writer("kube-apiserver")
"""The API server itself: the namespaces and CRDs it seeds."""


@dataclass(frozen=True)
class WatchEvent:
    """One change, as every watch of its storage resource may see it."""

    resource_version: int
    storage: ResourceKey
    type: str  # ADDED | MODIFIED | DELETED
    obj: Obj  # the new state (the last state for DELETED), storage form
    old: Obj | None  # the state before a MODIFIED, for selector transitions


@dataclass(frozen=True)
class WatchQuery:
    resource: ServedResource
    namespace: str | None
    name: str | None
    labels: tuple[selectors.LabelRequirement, ...] = ()
    fields: tuple[selectors.FieldRequirement, ...] = ()

    def selects(self, obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        if self.name is not None and meta.get("name") != self.name:
            return False
        return selectors.matches(obj, self.labels, self.fields)


def now_timestamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ClusterState:
    """All objects, the resourceVersion counter, the watch log, and the API's rules."""

    def __init__(
        self,
        objects: kmock.ObjectsArray,
        registry: resources.ResourceRegistry,
        *,
        on_resources_changed: Callable[[], None] | None = None,
        log_size: int = 20_000,
        history_size: int = 8,
    ) -> None:
        self.objects = objects
        self.registry = registry
        self._on_resources_changed = on_resources_changed
        # How many changes back a watch can resume; from further back it gets 410 Expired
        # (and kopf or an informer lists again), as from a real server's compacted history.
        self.log_size = log_size
        self._history_size = history_size
        self._resource_version = 0
        self._log: list[WatchEvent] = []
        self._log_floor = 0  # every event after this resourceVersion is still in the log
        self._wakeup = asyncio.Event()
        self._closed = False
        self._uids: dict[str, StoredKey] = {}
        self._policies: dict[str, str] = {}  # uid → propagation policy of its pending delete
        self._gone_owners: collections.deque[str] = collections.deque()
        self._emptying: set[StoredKey] = set()  # namespaces and CRDs waiting for contents
        self._kres: dict[ResourceKey, kmock.resource] = {}

    # ------------------------------------------------------------------ reading

    @property
    def resource_version(self) -> str:
        return str(self._resource_version)

    def get(self, resource: ServedResource, namespace: str | None, name: str) -> Obj:
        stored = self._live(self._key(resource, namespace, name))
        if stored is None:
            raise errors.not_found(resource, name)
        return resource.to_served(stored)

    def list_objects(self, query: WatchQuery) -> tuple[list[Obj], str]:
        items = []
        for key, stored in self._live_items(query.resource.storage_key):
            if query.namespace is not None and key[1] != query.namespace:
                continue
            served = query.resource.to_served(stored)
            if query.selects(served):
                items.append(served)
        items.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
        return items, self.resource_version

    # ------------------------------------------------------------------ writing

    def create(
        self,
        resource: ServedResource,
        namespace: str | None,
        body: Any,
        *,
        field_validation: str = "Ignore",
        writer: Writer = SERVER,
        applied: Mapping[str, Any] | None = None,
    ) -> tuple[Obj, list[str]]:
        """``applied``: the object is created by server-side apply of this configuration."""
        if not isinstance(body, Mapping):
            raise errors.bad_request("the request body must be a JSON object")
        obj = copy.deepcopy(dict(body))
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            meta = obj["metadata"] = {}
        namespace = self._object_namespace(resource, namespace, meta)
        storage = self.registry.storage_of(resource)
        name = meta.get("name") or self._generate_name(storage, namespace, meta)
        if namespace is not None:
            self._require_namespace(namespace, resource, name)
        self._validate_name(resource, name)
        obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
        if resource.status_subresource:
            obj.pop("status", None)  # status is the controllers' to write, never a creator's
        obj, warnings = self._apply_schema(resource, obj, name, field_validation)
        self._record_create(resource, obj, writer, applied)
        stored = resource.to_storage(obj)
        key = self._key(storage, namespace, name)
        if self._live(key) is not None:
            raise errors.already_exists(resource, name)
        meta = stored["metadata"] = dict(stored.get("metadata") or {})
        for server_owned in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
            meta.pop(server_owned, None)
        meta.update(
            name=name, uid=str(uuid.uuid4()), creationTimestamp=now_timestamp(), generation=1
        )
        if namespace is not None:
            meta["namespace"] = namespace
        self._builtin_defaults(storage, stored)
        if storage.key == resources.CRDS:
            self._serve_crd(stored)
        self._commit(key, storage, "ADDED", stored, None)
        self._settle()
        return resource.to_served(stored), warnings

    def replace(
        self,
        resource: ServedResource,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
        field_validation: str = "Ignore",
        writer: Writer = SERVER,
    ) -> tuple[Obj, list[str]]:
        if not isinstance(body, Mapping):
            raise errors.bad_request("the request body must be a JSON object")
        replacement = copy.deepcopy(dict(body))
        return self._update(
            resource,
            namespace,
            name,
            subresource,
            lambda _: (replacement, None),
            field_validation,
            writer,
        )

    def patch(
        self,
        resource: ServedResource,
        namespace: str | None,
        name: str,
        content_type: str,
        patch: Any,
        *,
        subresource: str | None = None,
        field_validation: str = "Ignore",
        writer: Writer = SERVER,
    ) -> tuple[Obj, list[str], bool]:
        """Returns the object, warnings, and whether it was created (server-side apply)."""
        if content_type == patching.APPLY_PATCH:
            return self._apply(
                resource, namespace, name, patch, subresource, field_validation, writer
            )
        if writer.force:
            cause = schema.FieldError(
                "force",
                "FieldValueForbidden",
                "Forbidden: may not be specified for non-apply patch",
            )
            raise errors.invalid("PatchOptions", "meta.k8s.io", "", [cause])

        def patched(current: Obj) -> tuple[Obj, None]:
            try:
                return patching.apply_patch(current, content_type, patch), None
            except patching.PatchError as exc:
                raise errors.api_error(422, "Invalid", str(exc)) from exc

        obj, warnings = self._update(
            resource, namespace, name, subresource, patched, field_validation, writer
        )
        return obj, warnings, False

    def _apply(
        self,
        resource: ServedResource,
        namespace: str | None,
        name: str,
        config: Any,
        subresource: str | None,
        field_validation: str,
        writer: Writer,
    ) -> tuple[Obj, list[str], bool]:
        """Server-side apply of ``config`` by ``writer`` (see ``managed_fields``); an
        object that does not exist is created from it."""
        if not writer.manager:
            cause = schema.FieldError(
                "fieldManager", "FieldValueRequired", "Required value: is required for apply patch"
            )
            raise errors.invalid("PatchOptions", "meta.k8s.io", "", [cause])
        if not isinstance(config, Mapping):
            raise errors.bad_request("the apply configuration must be an object")
        if config.get("apiVersion") != resource.api_version:
            api_version = str(config.get("apiVersion") or "")
            raise errors.bad_request(
                "Incorrect version specified in apply patch. Specified patch version: "
                f"{api_version}, expected: {resource.api_version}"
            )
        if config.get("kind") != resource.kind:
            group, _, version = resource.api_version.rpartition("/")
            raise errors.bad_request(
                f"invalid object type: {group}/{version}, Kind={config.get('kind') or ''}"
            )
        meta = config.get("metadata")
        if isinstance(meta, Mapping) and meta.get("managedFields") is not None:
            raise errors.bad_request("metadata.managedFields must be nil")
        storage = self.registry.storage_of(resource)
        if self._live(self._key(storage, namespace, name)) is None and not subresource:
            body = managed_fields.merge({}, config, managed_fields.root_shape(resource.schema))
            body.setdefault("metadata", {})["name"] = name
            created, warnings = self.create(
                resource,
                namespace,
                body,
                field_validation=field_validation,
                writer=writer,
                applied=config,
            )
            return created, warnings, True
        shape = managed_fields.root_shape(resource.schema)
        ignored = managed_fields.ignored_paths(
            subresource=subresource, status_subresource=resource.status_subresource
        )

        def applied(current: Obj) -> tuple[Obj, list[managed_fields.Entry]]:
            meta = current.setdefault("metadata", {})
            entries = managed_fields.decode(meta.pop("managedFields", None)) or []
            try:
                return managed_fields.applied(
                    entries,
                    current,
                    config,
                    shape,
                    manager=writer.manager,
                    api_version=resource.api_version,
                    subresource=subresource,
                    time=now_timestamp(),
                    force=writer.force,
                    ignored=ignored,
                )
            except managed_fields.ApplyConflict as exc:
                raise errors.api_error(
                    409, "Conflict", exc.message, {"causes": exc.causes()}
                ) from exc

        obj, warnings = self._update(
            resource, namespace, name, subresource, applied, field_validation, writer
        )
        return obj, warnings, False

    def delete(
        self,
        resource: ServedResource,
        namespace: str | None,
        name: str,
        options: Mapping[str, Any],
    ) -> tuple[Obj, bool]:
        """Returns the object and whether it is gone (False: waiting for finalizers)."""
        storage = self.registry.storage_of(resource)
        key = self._key(storage, namespace, name)
        current = self._live(key)
        if current is None:
            raise errors.not_found(resource, name)
        preconditions = options.get("preconditions") or {}
        meta = current["metadata"]
        for field in ("uid", "resourceVersion"):
            wanted = preconditions.get(field)
            if wanted and wanted != meta.get(field):
                raise errors.conflict(
                    resource,
                    name,
                    f"Precondition failed: {field} in precondition: {wanted}, "
                    f"{field} in object meta: {meta.get(field)}",
                )
        policy = options.get("propagationPolicy") or (
            "Orphan" if options.get("orphanDependents") else "Background"
        )
        if policy not in PROPAGATION_POLICIES:
            raise errors.api_error(
                422, "Invalid", f'propagationPolicy: Unsupported value: "{policy}"'
            )
        obj, gone = self._request_deletion(storage, key, policy)
        self._settle()
        return resource.to_served(obj), gone

    def delete_collection(self, query: WatchQuery, options: Mapping[str, Any]) -> list[Obj]:
        items, _ = self.list_objects(query)
        deleted = []
        for item in items:
            meta = item["metadata"]
            obj, _ = self.delete(query.resource, meta.get("namespace"), meta["name"], options)
            deleted.append(obj)
        return deleted

    # ------------------------------------------------------------------ persistence

    def snapshot(self) -> Snapshot:
        """The live objects, counter and pending deletion policies, as they are now.

        The objects are the stored dicts themselves, not copies: a caller encodes them at
        once, on the event loop, before any request can change them."""
        objects = [
            ((key[0].group or "", key[0].version or "", key[0].plural or ""), entry.raw)
            for key, entry in self.objects.items()
            if not entry.deleted
        ]
        return Snapshot(self._resource_version, objects, dict(self._policies))

    def restore(self, snapshot: Snapshot) -> None:
        """Load ``snapshot`` into this (empty) state, keeping every object's server-owned
        metadata as it was.

        CRDs go first, so their resources are served again before their objects are put
        back. The counter continues from the snapshot's, and the watch log starts empty
        above it, so a watch from an older resourceVersion gets 410 Expired. Namespaces
        and CRDs that were being deleted go on emptying, and dependents of owners that
        are gone (deleted in changes the snapshot did not see) are collected."""
        if self._resource_version or any(not e.deleted for e in self.objects.values()):
            raise RuntimeError("restore() needs an empty cluster state")
        ordered = sorted(snapshot.objects, key=lambda item: item[0] != resources.CRDS)
        newest = snapshot.resource_version
        for storage_key, obj in ordered:
            meta = obj.get("metadata") or {}
            name = meta.get("name")
            storage = self.registry.lookup(*storage_key)
            if storage is None or not isinstance(name, str) or not meta.get("uid"):
                what = "/".join(part for part in storage_key if part)
                raise SnapshotError(
                    f"{what} {meta.get('namespace') or ''}/{name}: "
                    + ("its resource is not served" if storage is None else "no name or uid")
                )
            if storage.key == resources.CRDS:
                try:
                    self._serve_crd(obj)
                except kmock.KubernetesError as exc:
                    raise SnapshotError(f"CRD {name}: {exc.message}") from exc
            key = self._key(storage, meta.get("namespace"), name)
            self.objects[key] = obj
            self._uids[meta["uid"]] = key
            if meta.get("deletionTimestamp") and storage.key in (
                resources.NAMESPACES,
                resources.CRDS,
            ):
                self._emptying.add(key)
            newest = max(newest, int(meta.get("resourceVersion") or 0))
        self._resource_version = self._log_floor = newest
        self._policies = {
            uid: policy for uid, policy in snapshot.deletion_policies.items() if uid in self._uids
        }
        owners = {
            str(ref.get("uid"))
            for _, obj in snapshot.objects
            for ref in obj["metadata"].get("ownerReferences") or []
            if ref.get("uid")
        }
        self._gone_owners.extend(sorted(owners - self._uids.keys()))
        self._settle()

    # ------------------------------------------------------------------ watching

    def open_watch(
        self, query: WatchQuery, *, since: str | None, send_initial: bool, timeout: float | None
    ) -> AsyncIterator[Obj]:
        """Validate the request now (errors become HTTP errors), stream later."""
        if since not in (None, "", "0"):
            try:
                cursor = int(since)
            except ValueError:
                raise errors.bad_request(f"invalid resourceVersion: {since!r}") from None
            initial = None
        else:
            items, _ = self.list_objects(query)
            cursor, initial = self._resource_version, items
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._stream(query, cursor, initial, send_initial, deadline)

    async def _stream(
        self,
        query: WatchQuery,
        cursor: int,
        initial: list[Obj] | None,
        send_initial: bool,
        deadline: float | None,
    ) -> AsyncIterator[Obj]:
        resource = query.resource
        for item in initial or []:
            yield {"type": "ADDED", "object": item}
        if send_initial:
            yield self._bookmark(resource, cursor, initial_events_end=True)
        while not self._closed:
            wakeup = self._wakeup  # captured first: a change while we yield sets this one
            if cursor < self._log_floor:
                yield {
                    "type": "ERROR",
                    "object": errors.status_body(
                        410, "Expired", f"too old resource version: {cursor} ({self._log_floor})"
                    ),
                }
                return
            start = bisect.bisect_right(self._log, cursor, key=lambda e: e.resource_version)
            for event in self._log[start:]:
                cursor = event.resource_version
                if event.storage == resource.storage_key:
                    translated = self._translate(query, event)
                    if translated is not None:
                        yield translated
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            try:
                async with asyncio.timeout(remaining):
                    await wakeup.wait()
            except TimeoutError:
                return

    def _translate(self, query: WatchQuery, event: WatchEvent) -> Obj | None:
        """The event as this watch sees it: an object entering or leaving its selection
        is ADDED or DELETED, as a real API server reports it."""
        new = query.resource.to_served(event.obj)
        now_selected = query.selects(new)
        if event.type != "MODIFIED" or event.old is None:
            return {"type": event.type, "object": new} if now_selected else None
        was_selected = query.selects(query.resource.to_served(event.old))
        if now_selected and was_selected:
            return {"type": "MODIFIED", "object": new}
        if now_selected:
            return {"type": "ADDED", "object": new}
        if was_selected:
            return {"type": "DELETED", "object": new}
        return None

    def _bookmark(self, resource: ServedResource, rv: int, *, initial_events_end: bool) -> Obj:
        meta: Obj = {"resourceVersion": str(rv)}
        if initial_events_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        body = {"apiVersion": resource.api_version, "kind": resource.kind, "metadata": meta}
        return {"type": "BOOKMARK", "object": body}

    def close(self) -> None:
        """End every watch stream (the server is stopping)."""
        self._closed = True
        self._wakeup.set()

    # ------------------------------------------------------------------ internals: keys

    def _kmock_resource(self, key: ResourceKey) -> kmock.resource:
        if key not in self._kres:
            self._kres[key] = kmock.resource(*key)
        return self._kres[key]

    def _key(self, resource: ServedResource, namespace: str | None, name: str) -> StoredKey:
        storage_key = resource.storage_key
        return (self._kmock_resource(storage_key), namespace if resource.namespaced else None, name)

    def _storage_of_key(self, key: StoredKey) -> ServedResource | None:
        res = key[0]
        return self.registry.lookup(res.group or "", res.version or "", res.plural or "")

    def _live(self, key: StoredKey) -> Obj | None:
        if key not in self.objects:
            return None
        entry = self.objects[key]
        return None if entry.deleted else entry.raw

    def _live_items(self, storage_key: ResourceKey) -> list[tuple[StoredKey, Obj]]:
        wanted = self._kmock_resource(storage_key)
        return [
            (key, entry.raw)
            for key, entry in self.objects.items()
            if key[0] == wanted and not entry.deleted
        ]

    # ------------------------------------------------------------------ internals: rules

    def _object_namespace(
        self, resource: ServedResource, url_namespace: str | None, meta: dict[str, Any]
    ) -> str | None:
        if not resource.namespaced:
            meta.pop("namespace", None)
            return None
        body_namespace = meta.get("namespace")
        if url_namespace and body_namespace and body_namespace != url_namespace:
            raise errors.bad_request(
                "the namespace of the provided object does not match the namespace sent on "
                "the request"
            )
        namespace = url_namespace or body_namespace or "default"
        meta["namespace"] = namespace
        return str(namespace)

    def _require_namespace(self, namespace: str, resource: ServedResource, name: str) -> None:
        """New objects need a namespace that exists and is not being deleted."""
        ns_resource = self.registry.lookup(*resources.NAMESPACES)
        assert ns_resource is not None  # a built-in, always served
        found = self._live(self._key(ns_resource, None, namespace))
        if found is None:
            raise errors.not_found(ns_resource, namespace)
        if found["metadata"].get("deletionTimestamp"):
            raise errors.namespace_terminating(resource, name, namespace)

    def _generate_name(
        self, storage: ServedResource, namespace: str | None, meta: Mapping[str, Any]
    ) -> str:
        prefix = meta.get("generateName")
        if not prefix:
            raise errors.api_error(
                422, "Invalid", "metadata.name: Required value: name or generateName is required"
            )
        while True:
            name = str(prefix) + "".join(secrets.choice(_NAME_SUFFIX_ALPHABET) for _ in range(5))
            if self._live(self._key(storage, namespace, name)) is None:
                return name

    def _validate_name(self, resource: ServedResource, name: Any) -> None:
        is_namespace = resource.storage_key == resources.NAMESPACES
        valid = is_dns_label if is_namespace else is_dns_subdomain
        if not valid(name):
            what = "RFC 1123 label" if is_namespace else "RFC 1123 subdomain"
            cause = schema.FieldError(
                "metadata.name",
                "FieldValueInvalid",
                f'Invalid value: "{name}": a lowercase {what} must consist of lower '
                "case alphanumeric characters, '-' or '.', and must start and end with an "
                "alphanumeric character",
            )
            raise errors.invalid(resource.kind, resource.group, str(name), [cause])

    def _apply_schema(
        self,
        resource: ServedResource,
        obj: Obj,
        name: str,
        field_validation: str,
        old: Obj | None = None,
    ) -> tuple[Obj, list[str]]:
        """The object pruned and defaulted, or 422 if it breaks the schema or one of its
        CEL rules; ``old`` is the object an update replaces (transition rules)."""
        if resource.schema is None:
            return obj, []
        pruned, unknown = schema.prune_and_default(obj, resource.schema)
        problems = schema.validate(pruned, resource.schema)
        problems += cel.validate(pruned, resource.schema, old, prior=problems)
        if problems:
            raise errors.invalid(resource.kind, resource.group, name, problems)
        texts = [f'unknown field "{path}"' for path in unknown]
        if texts and field_validation == "Strict":
            raise errors.bad_request("strict decoding error: " + ", ".join(texts))
        return pruned, texts if field_validation == "Warn" else []

    def _builtin_defaults(self, storage: ServedResource, obj: Obj) -> None:
        """What a real API server's create strategies fill in for the built-ins."""
        if storage.key == resources.NAMESPACES:
            spec = obj.setdefault("spec", {})
            spec["finalizers"] = [resources.NAMESPACE_FINALIZER]
            obj["status"] = {"phase": "Active"}
        elif storage.key in (("", "v1", "persistentvolumeclaims"), ("", "v1", "pods")):
            obj["status"] = {"phase": "Pending"}
        elif storage.key == resources.CRDS:
            meta = obj["metadata"]
            finalizers = list(meta.get("finalizers") or [])
            if resources.CRD_CLEANUP_FINALIZER not in finalizers:
                finalizers.append(resources.CRD_CLEANUP_FINALIZER)
            meta["finalizers"] = finalizers
            spec = obj.get("spec") or {}
            names = dict(spec.get("names") or {})
            names.setdefault("singular", str(names.get("kind", "")).lower())
            names.setdefault("listKind", f"{names.get('kind', '')}List")
            stamp = now_timestamp()
            storage_versions = [
                v.get("name") for v in spec.get("versions") or [] if v.get("storage")
            ]
            obj["status"] = {
                "acceptedNames": names,
                "storedVersions": storage_versions,
                "conditions": [
                    {
                        "type": "NamesAccepted",
                        "status": "True",
                        "reason": "NoConflicts",
                        "message": "no conflicts found",
                        "lastTransitionTime": stamp,
                    },
                    {
                        "type": "Established",
                        "status": "True",
                        "reason": "InitialNamesAccepted",
                        "message": "the initial names have been accepted",
                        "lastTransitionTime": stamp,
                    },
                ],
            }

    def _serve_crd(self, crd: Obj) -> None:
        rule_problems = cel.check_crd(crd)
        if rule_problems:
            name = str(crd.get("metadata", {}).get("name"))
            raise errors.invalid(
                "CustomResourceDefinition", "apiextensions.k8s.io", name, rule_problems
            )
        try:
            served = self.registry.register_crd(crd)
        except resources.CrdError as exc:
            name = str(crd.get("metadata", {}).get("name"))
            cause = schema.FieldError(exc.field, "FieldValueInvalid", exc.detail)
            raise errors.invalid(
                "CustomResourceDefinition", "apiextensions.k8s.io", name, [cause]
            ) from exc
        log.info(
            "crd served name=%s endpoints=%s",
            crd["metadata"]["name"],
            ",".join(f"{r.api_version}/{r.plural}" for r in served),
        )
        self._move_to_storage_version(served)
        if self._on_resources_changed is not None:
            self._on_resources_changed()

    def _move_to_storage_version(self, served: list[ServedResource]) -> None:
        """Objects of a CRD stored at a version that is no longer its storage version (a
        CRD replaced by one that stores another, e.g. a restored state from before an
        upgrade) are stored again at the new one, converted as a write through their old
        version would convert them: an API server reads any version it stored, so no
        object is lost from view. Their metadata (uid, resourceVersion) stays; no watch
        event, since nothing about them changed."""
        if not served:
            return
        storage_key = served[0].storage_key
        group, version, plural = storage_key
        storage = self.registry.lookup(*storage_key)
        if storage is None:
            return
        convert = conversion.converter_for(served[0].crd_name or "")
        for key, entry in list(self.objects.items()):
            res = key[0]
            stored_as = (res.group or "", res.version or "", res.plural or "")
            if entry.deleted or stored_as == storage_key or stored_as[::2] != (group, plural):
                continue
            old = self.registry.lookup(*stored_as)
            obj = {**entry.raw, "apiVersion": f"{group}/{stored_as[1]}"}
            if old is not None:
                moved = old.to_storage(obj)
            elif convert is not None:
                moved = convert(obj, version)
            else:
                moved = {**obj, "apiVersion": f"{group}/{version}"}
            new_key = self._key(storage, key[1], key[2])
            entry.delete()
            if new_key in self.objects:
                self.objects[new_key].history.append(moved)
            else:
                self.objects[new_key] = moved
            uid = moved["metadata"].get("uid")
            if uid:
                self._uids[uid] = new_key
            log.info(
                "stored again name=%s/%s from=%s to=%s", key[1] or "", key[2], stored_as[1], version
            )

    def _update(
        self,
        resource: ServedResource,
        namespace: str | None,
        name: str,
        subresource: str | None,
        make_candidate: Callable[[Obj], tuple[Obj, list[managed_fields.Entry] | None]],
        field_validation: str,
        writer: Writer,
    ) -> tuple[Obj, list[str]]:
        """``make_candidate`` returns the object the write asks for and, for an apply,
        the managedFields entries it leaves (otherwise they follow from the change)."""
        storage = self.registry.storage_of(resource)
        key = self._key(storage, namespace, name)
        stored = self._live(key)
        if stored is None:
            raise errors.not_found(resource, name)
        current = resource.to_served(stored)
        candidate, entries = make_candidate(copy.deepcopy(current))
        if not isinstance(candidate, dict) or not isinstance(candidate.get("metadata", {}), dict):
            raise errors.bad_request("the object must be a JSON object with object metadata")
        self._check_identity(resource, name, current, candidate)
        new = self._compose(resource, current, candidate, subresource)
        new, warnings = self._apply_schema(resource, new, name, field_validation, current)
        if entries is None:
            entries = self._updated_entries(resource, current, candidate, new, subresource, writer)
        _set_entries(new, entries)
        self._check_finalizers(resource, name, current, new)
        if storage.key == resources.CRDS and not new["metadata"].get("deletionTimestamp"):
            self._serve_crd(new)
        result = self._commit_update(storage, key, stored, resource.to_storage(new))
        self._settle()
        return resource.to_served(result), warnings

    def _record_create(
        self,
        resource: ServedResource,
        obj: Obj,
        writer: Writer,
        applied: Mapping[str, Any] | None,
    ) -> None:
        """Set the managedFields of a new object: the applier's configuration, or what
        the creator set (after any the client sent, as a real server takes them)."""
        shape = managed_fields.root_shape(resource.schema)
        ignored = managed_fields.ignored_paths(
            subresource=None, status_subresource=resource.status_subresource
        )
        meta = obj["metadata"]
        sent = meta.pop("managedFields", None)
        if applied is not None:
            fields = frozenset(
                p for p in managed_fields.field_set(applied, shape) if not ignored(p)
            )
            entry = managed_fields.Entry(
                writer.manager, managed_fields.APPLY, resource.api_version, now_timestamp(), fields
            )
            entries = [entry] if fields else []
        else:
            entries = managed_fields.updated(
                managed_fields.requested_entries(None, sent, subresource=None),
                {},
                obj,
                shape,
                manager=writer.manager,
                api_version=resource.api_version,
                subresource=None,
                time=now_timestamp(),
                ignored=ignored,
            )
        _set_entries(obj, entries)

    def _updated_entries(
        self,
        resource: ServedResource,
        current: Obj,
        candidate: Obj,
        new: Obj,
        subresource: str | None,
        writer: Writer,
    ) -> list[managed_fields.Entry]:
        """The managedFields after a write that is not an apply: the writer owns what it
        changed (see ``managed_fields.updated``)."""
        before = copy.deepcopy(current)
        live = before["metadata"].pop("managedFields", None)
        after = copy.deepcopy(new)
        after["metadata"].pop("managedFields", None)
        sent = (candidate.get("metadata") or {}).get("managedFields")
        return managed_fields.updated(
            managed_fields.requested_entries(live, sent, subresource=subresource),
            before,
            after,
            managed_fields.root_shape(resource.schema),
            manager=writer.manager,
            api_version=resource.api_version,
            subresource=subresource,
            time=now_timestamp(),
            ignored=managed_fields.ignored_paths(
                subresource=subresource, status_subresource=resource.status_subresource
            ),
        )

    def _check_identity(
        self, resource: ServedResource, name: str, current: Obj, candidate: Obj
    ) -> None:
        meta = candidate.get("metadata") or {}
        current_meta = current["metadata"]
        wanted_version = meta.get("resourceVersion")
        if wanted_version not in (None, "") and wanted_version != current_meta.get(
            "resourceVersion"
        ):
            raise errors.conflict(
                resource,
                name,
                "the object has been modified; please apply your changes to the latest version "
                "and try again",
            )
        if meta.get("uid") not in (None, "", current_meta.get("uid")):
            raise errors.conflict(
                resource,
                name,
                f"Precondition failed: UID in precondition: {meta.get('uid')}, "
                f"UID in object meta: {current_meta.get('uid')}",
            )
        if meta.get("name") not in (None, "", name):
            raise errors.bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the URL "
                f"({name})"
            )

    def _compose(
        self, resource: ServedResource, current: Obj, candidate: Obj, subresource: str | None
    ) -> Obj:
        if subresource == "status":
            new = copy.deepcopy(current)
            if "status" in candidate:
                new["status"] = candidate["status"]
            else:
                new.pop("status", None)
            return new
        if subresource == "finalize" and resource.storage_key == resources.NAMESPACES:
            new = copy.deepcopy(current)
            new.setdefault("spec", {})["finalizers"] = (candidate.get("spec") or {}).get(
                "finalizers"
            ) or []
            return new
        if subresource is not None:
            raise errors.unknown_resource()
        new = candidate
        if resource.status_subresource:
            if "status" in current:
                new["status"] = current["status"]
            else:
                new.pop("status", None)
        meta = new.setdefault("metadata", {})
        for server_owned in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "generation",
            "resourceVersion",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ):
            if server_owned in current["metadata"]:
                meta[server_owned] = current["metadata"][server_owned]
            else:
                meta.pop(server_owned, None)
        new["apiVersion"], new["kind"] = resource.api_version, resource.kind
        return new

    def _check_finalizers(
        self, resource: ServedResource, name: str, current: Obj, new: Obj
    ) -> None:
        if not current["metadata"].get("deletionTimestamp"):
            return
        before = set(current["metadata"].get("finalizers") or [])
        added = [f for f in new["metadata"].get("finalizers") or [] if f not in before]
        if added:
            cause = schema.FieldError(
                "metadata.finalizers",
                "FieldValueForbidden",
                "Forbidden: no new finalizers can be added if the object is "
                f"being deleted, found new finalizers {added}",
            )
            raise errors.invalid(resource.kind, resource.group, name, [cause])

    def _commit_update(self, storage: ServedResource, key: StoredKey, old: Obj, new: Obj) -> Obj:
        """Store a changed object (or remove it when its deletion has nothing left to
        wait for). A no-op write changes nothing, not even the resourceVersion."""
        if new == old:
            return old
        if _spec_of(new, storage) != _spec_of(old, storage):
            new["metadata"]["generation"] = int(old["metadata"].get("generation") or 1) + 1
        if new["metadata"].get("deletionTimestamp") and not _has_finalizers(storage, new):
            return self._remove(key, storage, new)
        self._commit(key, storage, "MODIFIED", new, old)
        return new

    def _request_deletion(
        self, storage: ServedResource, key: StoredKey, policy: str
    ) -> tuple[Obj, bool]:
        current = self._live(key)
        assert current is not None  # callers look it up first
        meta = current["metadata"]
        if meta.get("deletionTimestamp"):
            return current, False  # already on its way; the first request's policy stands
        self._policies[meta["uid"]] = policy
        if not _has_finalizers(storage, current):
            return self._remove(key, storage, current), True
        new = copy.deepcopy(current)
        new["metadata"]["deletionTimestamp"] = now_timestamp()
        new["metadata"]["deletionGracePeriodSeconds"] = 0
        new["metadata"]["generation"] = int(meta.get("generation") or 1) + 1
        if storage.key == resources.NAMESPACES:
            new.setdefault("status", {})["phase"] = "Terminating"
        if storage.key in (resources.NAMESPACES, resources.CRDS):
            self._emptying.add(key)
        self._commit(key, storage, "MODIFIED", new, current)
        return new, False

    def _remove(self, key: StoredKey, storage: ServedResource, last: Obj) -> Obj:
        final = copy.deepcopy(last)
        self._resource_version += 1
        final["metadata"]["resourceVersion"] = self.resource_version
        entry = self.objects[key]
        entry.history.append(final)
        entry.delete()
        self._trim_history(key)
        uid = final["metadata"].get("uid")
        if uid:
            self._uids.pop(uid, None)
            self._gone_owners.append(uid)
        self._log_event(WatchEvent(self._resource_version, storage.key, "DELETED", final, None))
        if storage.key == resources.CRDS:
            gone = self.registry.unregister_crd(final["metadata"]["name"])
            log.info("crd removed name=%s endpoints=%d", final["metadata"]["name"], len(gone))
            if self._on_resources_changed is not None:
                self._on_resources_changed()
        return final

    def _commit(
        self, key: StoredKey, storage: ServedResource, kind: str, new: Obj, old: Obj | None
    ) -> None:
        self._resource_version += 1
        new["metadata"]["resourceVersion"] = self.resource_version
        if key in self.objects:
            self.objects[key].history.append(new)
            self._trim_history(key)
        else:
            self.objects[key] = new
        uid = new["metadata"].get("uid")
        if uid:
            self._uids[uid] = key
        self._log_event(WatchEvent(self._resource_version, storage.key, kind, new, old))

    def _trim_history(self, key: StoredKey) -> None:
        history = self.objects[key].history
        if len(history) > self._history_size:
            del history[: len(history) - self._history_size]

    def _log_event(self, event: WatchEvent) -> None:
        self._log.append(event)
        if len(self._log) > self.log_size:
            dropped = len(self._log) // 2
            self._log_floor = self._log[dropped - 1].resource_version
            del self._log[:dropped]
        self._wakeup.set()
        self._wakeup = asyncio.Event()

    # ------------------------------------------------------------------ internals: controllers

    def _settle(self) -> None:
        """Run the API server's own controllers until nothing changes: garbage collection
        of dependents, and namespaces and CRDs that wait for their contents to go."""
        changed = True
        while changed:
            changed = False
            while self._gone_owners:
                changed |= self._collect_dependents(self._gone_owners.popleft())
            for key in sorted(self._emptying, key=repr):
                changed |= self._empty(key)

    def _collect_dependents(self, owner_uid: str) -> bool:
        policy = self._policies.pop(owner_uid, "Background")
        changed = False
        for key, entry in list(self.objects.items()):
            if entry.deleted:
                continue
            obj = entry.raw
            refs = obj["metadata"].get("ownerReferences") or []
            if not any(ref.get("uid") == owner_uid for ref in refs):
                continue
            storage = self._storage_of_key(key)
            if storage is None:
                continue
            remaining = [ref for ref in refs if ref.get("uid") != owner_uid]
            if policy == "Orphan" or any(ref.get("uid") in self._uids for ref in remaining):
                new = copy.deepcopy(obj)
                if remaining:
                    new["metadata"]["ownerReferences"] = remaining
                else:
                    new["metadata"].pop("ownerReferences", None)
                self._commit_update(storage, key, obj, new)
            else:
                log.debug("gc dependent=%s/%s owner_uid=%s", key[1], key[2], owner_uid)
                self._request_deletion(storage, key, "Background")
            changed = True
        return changed

    def _empty(self, key: StoredKey) -> bool:
        container = self._live(key)
        storage = self._storage_of_key(key)
        if container is None or storage is None:
            self._emptying.discard(key)
            return False
        if storage.key == resources.NAMESPACES:
            contents = [k for k, e in self.objects.items() if not e.deleted and k[1] == key[2]]
            system_finalizer = resources.NAMESPACE_FINALIZER
        else:
            stored_as = {
                self._kmock_resource(r.storage_key) for r in self.registry.served_by_crd(key[2])
            }
            contents = [k for k, e in self.objects.items() if not e.deleted and k[0] in stored_as]
            system_finalizer = resources.CRD_CLEANUP_FINALIZER
        changed = False
        for content_key in contents:
            content = self._live(content_key)
            content_storage = self._storage_of_key(content_key)
            if content and content_storage and not content["metadata"].get("deletionTimestamp"):
                self._request_deletion(content_storage, content_key, "Background")
                changed = True
        if any(self._live(k) is not None for k in contents):
            return changed
        new = copy.deepcopy(container)
        if storage.key == resources.NAMESPACES:
            spec = new.setdefault("spec", {})
            spec["finalizers"] = [f for f in spec.get("finalizers") or [] if f != system_finalizer]
        else:
            new["metadata"]["finalizers"] = [
                f for f in new["metadata"].get("finalizers") or [] if f != system_finalizer
            ]
        self._emptying.discard(key)
        self._commit_update(storage, key, container, new)
        return True


def _set_entries(obj: Obj, entries: list[managed_fields.Entry]) -> None:
    meta = obj.setdefault("metadata", {})
    if entries:
        meta["managedFields"] = managed_fields.encode(entries)
    else:
        meta.pop("managedFields", None)


def _spec_of(obj: Mapping[str, Any], storage: ServedResource) -> dict[str, Any]:
    """What ``generation`` counts: everything but metadata (and status, when it has its
    own subresource)."""
    return {
        k: v
        for k, v in obj.items()
        if k not in ("metadata", "apiVersion", "kind")
        and not (k == "status" and storage.status_subresource)
    }


def _has_finalizers(storage: ServedResource, obj: Mapping[str, Any]) -> bool:
    if obj.get("metadata", {}).get("finalizers"):
        return True
    return storage.key == resources.NAMESPACES and bool((obj.get("spec") or {}).get("finalizers"))
