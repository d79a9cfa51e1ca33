"""Which resources the embedded Kubernetes API serves, and how each one is stored.

A :class:`ServedResource` is one ``group/version/plural`` endpoint: what discovery says
about it (kind, singular, shortNames, verbs, scope, the ``status`` subresource), the
Table columns ``kubectl get`` prints, the schema that prunes, defaults and validates its
objects, and the storage it maps to. Several endpoints can share one storage: the
versions of a CRD (the storage version's objects, re-labelled, or converted where the
CRD's conversion is a webhook (``conversion``), and pruned per version)
and ``events.k8s.io/v1`` events (core ``v1`` events with the fields renamed), so
``kubectl get events`` shows events whichever API the writer used.

:class:`ResourceRegistry` holds the built-ins at start and grows and shrinks as CRDs are
created and removed (``store`` tells it). ``emulator`` serves discovery from it.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator.devcluster import conversion
from orchestrator.devcluster import schema as schemas
from orchestrator.devcluster.tables import PrinterColumn, age_column, age_since

Obj = dict[str, Any]
ResourceKey = tuple[str, str, str]  # (group, version, plural)
Conversion = Callable[[Mapping[str, Any]], Obj]

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
STATUS_VERBS = ("get", "patch", "update")

NAMESPACES: ResourceKey = ("", "v1", "namespaces")
CORE_EVENTS: ResourceKey = ("", "v1", "events")
CRDS: ResourceKey = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")
CRD_CLEANUP_FINALIZER = "customresourcecleanup.apiextensions.k8s.io"
NAMESPACE_FINALIZER = "kubernetes"


@dataclass(frozen=True)
class ServedResource:
    group: str
    version: str
    plural: str
    kind: str
    singular: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    verbs: tuple[str, ...] = ALL_VERBS
    status_subresource: bool = False
    columns: tuple[PrinterColumn, ...] = (age_column(),)
    schema: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    storage: ResourceKey | None = None  # None: this endpoint is its own storage
    into_storage: Conversion | None = field(default=None, compare=False, repr=False)
    from_storage: Conversion | None = field(default=None, compare=False, repr=False)
    crd_name: str | None = None  # the CRD that serves it; None for built-ins
    deprecation_warning: str | None = None  # a CRD version marked deprecated: the warning

    @property
    def key(self) -> ResourceKey:
        return (self.group, self.version, self.plural)

    @property
    def storage_key(self) -> ResourceKey:
        return self.storage or self.key

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        """How the API names it in messages: ``calibantasks.caliban.caliban-ai.dev``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def to_storage(self, obj: Mapping[str, Any]) -> Obj:
        return self.into_storage(obj) if self.into_storage else dict(obj)

    def to_served(self, obj: Mapping[str, Any]) -> Obj:
        return self.from_storage(obj) if self.from_storage else dict(obj)


# ------------------------------------------------------------------ built-in catalogue


def _path(obj: Mapping[str, Any], *keys: str) -> Any:
    value: Any = obj
    for key in keys:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def _pod_ready(obj: Mapping[str, Any], _: datetime.datetime) -> str:
    statuses = _path(obj, "status", "containerStatuses") or []
    containers = _path(obj, "spec", "containers") or []
    return f"{sum(1 for s in statuses if s.get('ready'))}/{len(containers)}"


def _pod_status(obj: Mapping[str, Any], _: datetime.datetime) -> str:
    if _path(obj, "metadata", "deletionTimestamp"):
        return "Terminating"
    return str(_path(obj, "status", "phase") or "Pending")


def _pod_restarts(obj: Mapping[str, Any], _: datetime.datetime) -> int:
    return sum(
        int(s.get("restartCount", 0)) for s in _path(obj, "status", "containerStatuses") or []
    )


_ACCESS_MODES = {
    "ReadWriteOnce": "RWO",
    "ReadOnlyMany": "ROX",
    "ReadWriteMany": "RWX",
    "ReadWriteOncePod": "RWOP",
}


def _pvc_access(obj: Mapping[str, Any], _: datetime.datetime) -> str:
    modes = _path(obj, "status", "accessModes") or _path(obj, "spec", "accessModes") or []
    return ",".join(_ACCESS_MODES.get(m, m) for m in modes)


def _event_last_seen(obj: Mapping[str, Any], now: datetime.datetime) -> str | None:
    for keys in (
        ("lastTimestamp",),
        ("deprecatedLastTimestamp",),
        ("eventTime",),
        ("series", "lastObservedTime"),
        ("metadata", "creationTimestamp"),
    ):
        if seen := age_since(_path(obj, *keys), now):
            return seen
    return None


def _event_object(reference_field: str) -> Callable[[Mapping[str, Any], datetime.datetime], str]:
    def cell(obj: Mapping[str, Any], _: datetime.datetime) -> str:
        ref = obj.get(reference_field) or {}
        return f"{str(ref.get('kind', '')).lower()}/{ref.get('name', '')}"

    return cell


def _count(*keys: str) -> Callable[[Mapping[str, Any], datetime.datetime], int]:
    def cell(obj: Mapping[str, Any], _: datetime.datetime) -> int:
        return sum(len(obj.get(key) or {}) for key in keys)

    return cell


def _column(name: str, json_path: str, type_: str = "string", priority: int = 0) -> PrinterColumn:
    return PrinterColumn(name=name, type=type_, json_path=json_path, priority=priority)


def _computed(
    name: str, cell: Callable[[Mapping[str, Any], datetime.datetime], Any], type_: str = "string"
) -> PrinterColumn:
    return PrinterColumn(name=name, type=type_, cell=cell)


# The same event in both APIs: core v1 field → events.k8s.io/v1 field.
_EVENTS_V1_NAMES = {
    "involvedObject": "regarding",
    "message": "note",
    "source": "deprecatedSource",
    "firstTimestamp": "deprecatedFirstTimestamp",
    "lastTimestamp": "deprecatedLastTimestamp",
    "count": "deprecatedCount",
    "reportingComponent": "reportingController",
}
_CORE_EVENT_NAMES = {v1: core for core, v1 in _EVENTS_V1_NAMES.items()}


def _event_renamed(obj: Mapping[str, Any], api_version: str, names: Mapping[str, str]) -> Obj:
    out: Obj = {"apiVersion": api_version, "kind": "Event", "metadata": obj.get("metadata", {})}
    for key, value in obj.items():
        if key not in ("apiVersion", "kind", "metadata"):
            out[names.get(key, key)] = value
    return out


def _events_v1_from_core(obj: Mapping[str, Any]) -> Obj:
    """A core ``v1`` Event as ``events.k8s.io/v1`` shows it."""
    out = _event_renamed(obj, "events.k8s.io/v1", _EVENTS_V1_NAMES)
    if "reportingController" not in out and _path(obj, "source", "component"):
        out["reportingController"] = obj["source"]["component"]
    return out


def _events_v1_into_core(obj: Mapping[str, Any]) -> Obj:
    out = _event_renamed(obj, "v1", _CORE_EVENT_NAMES)
    if "source" not in out and out.get("reportingComponent"):
        out["source"] = {"component": out["reportingComponent"]}
    return out


def _core(plural: str, kind: str, **details: Any) -> ServedResource:
    """A namespaced core ``v1`` resource unless ``details`` say otherwise."""
    details.setdefault("namespaced", True)
    return ServedResource("", "v1", plural, kind, kind.lower(), **details)


def _pod_selector(obj: Mapping[str, Any], _: datetime.datetime) -> str:
    labels = ((obj.get("spec") or {}).get("podSelector") or {}).get("matchLabels") or {}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "<none>"


def builtin_resources() -> list[ServedResource]:
    """The built-ins: what the operator, the Sandbox stand-in and kubectl users touch."""
    age = age_column()
    event_columns = (
        _computed("Last Seen", _event_last_seen),
        _column("Type", ".type"),
        _column("Reason", ".reason"),
    )
    return [
        _core("namespaces", "Namespace", namespaced=False, short_names=("ns",),
              status_subresource=True, columns=(_column("Status", ".status.phase"), age)),
        _core("events", "Event", short_names=("ev",),
              columns=(*event_columns, _computed("Object", _event_object("involvedObject")),
                       _column("Message", ".message"))),
        _core("pods", "Pod", short_names=("po",), categories=("all",), status_subresource=True,
              columns=(_computed("Ready", _pod_ready), _computed("Status", _pod_status),
                       _computed("Restarts", _pod_restarts, "integer"), age)),
        _core("persistentvolumeclaims", "PersistentVolumeClaim", short_names=("pvc",),
              status_subresource=True,
              columns=(_column("Status", ".status.phase"), _column("Volume", ".spec.volumeName"),
                       _column("Capacity", ".status.capacity.storage"),
                       _computed("Access Modes", _pvc_access),
                       _column("StorageClass", ".spec.storageClassName"), age)),
        _core("configmaps", "ConfigMap", short_names=("cm",),
              columns=(_computed("Data", _count("data", "binaryData"), "integer"), age)),
        _core("secrets", "Secret",
              columns=(_column("Type", ".type"), _computed("Data", _count("data"), "integer"),
                       age)),
        _core("services", "Service", short_names=("svc",), categories=("all",),
              status_subresource=True,
              columns=(_column("Type", ".spec.type"), _column("Cluster-IP", ".spec.clusterIP"),
                       age)),
        ServedResource(
            "policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget",
            "poddisruptionbudget", namespaced=True, short_names=("pdb",), status_subresource=True,
            columns=(_column("Min Available", ".spec.minAvailable"),
                     _column("Max Unavailable", ".spec.maxUnavailable"), age),
        ),
        ServedResource(
            "networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", "networkpolicy",
            namespaced=True, short_names=("netpol",),
            columns=(_computed("Pod-Selector", _pod_selector), age),
        ),
        ServedResource(
            "apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
            "customresourcedefinition", namespaced=False, short_names=("crd", "crds"),
            categories=("api-extensions",), status_subresource=True,
            columns=(PrinterColumn(name="Created At", json_path=".metadata.creationTimestamp",
                                   format="date-time"),),
        ),
        ServedResource(
            "events.k8s.io", "v1", "events", "Event", "event", namespaced=True,
            short_names=("ev",), storage=CORE_EVENTS,
            into_storage=_events_v1_into_core, from_storage=_events_v1_from_core,
            columns=(*event_columns, _computed("Object", _event_object("regarding")),
                     _column("Message", ".note")),
        ),
    ]  # fmt: skip


# ------------------------------------------------------------------ custom resources


class CrdError(ValueError):
    """A CRD the API cannot serve (422 Invalid), with the field that says why."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail


def served_from_crd(crd: Mapping[str, Any]) -> list[ServedResource]:
    """The endpoints a CRD serves: one per served version, all on the storage version."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group, plural, kind = spec.get("group"), names.get("plural"), names.get("kind")
    for value, where in (
        (group, "spec.group"),
        (plural, "spec.names.plural"),
        (kind, "spec.names.kind"),
    ):
        if not isinstance(value, str) or not value:
            raise CrdError(where, "Required value")
    assert isinstance(group, str) and isinstance(plural, str) and isinstance(kind, str)
    name = crd.get("metadata", {}).get("name")
    if name != f"{plural}.{group}":
        raise CrdError(
            "metadata.name",
            f'Invalid value: "{name}": must be spec.names.plural+"."+spec.group '
            f'("{plural}.{group}")',
        )
    versions = [v for v in spec.get("versions") or [] if isinstance(v, Mapping)]
    if not versions:
        raise CrdError(
            "spec.versions", "Invalid value: []: must have exactly one version marked as storage"
        )
    storage_versions = [v["name"] for v in versions if v.get("storage")]
    if len(storage_versions) != 1:
        raise CrdError(
            "spec.versions",
            f"Invalid value: {storage_versions}: must have exactly one version marked as storage",
        )
    storage: ResourceKey = (group, storage_versions[0], plural)
    convert = _conversion(name, spec.get("conversion"))
    served = []
    for version in versions:
        if not version.get("served", True):
            continue
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        api_version = f"{group}/{version['name']}"
        served.append(
            ServedResource(
                group,
                version["name"],
                plural,
                kind,
                singular=names.get("singular") or kind.lower(),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                status_subresource="status" in (version.get("subresources") or {}),
                columns=_crd_columns(version),
                schema=schema,
                storage=None if version["name"] == storage[1] else storage,
                into_storage=_converted(f"{group}/{storage[1]}", None, convert),
                from_storage=_converted(api_version, schema, convert),
                crd_name=name,
                deprecation_warning=(
                    str(version.get("deprecationWarning") or f"{api_version} {kind} is deprecated")
                    if version.get("deprecated")
                    else None
                ),
            )
        )
    return served


def _crd_columns(version: Mapping[str, Any]) -> tuple[PrinterColumn, ...]:
    columns = version.get("additionalPrinterColumns")
    if not columns:
        return (age_column(),)
    return tuple(
        PrinterColumn(
            name=c["name"],
            type=c.get("type", "string"),
            json_path=c.get("jsonPath"),
            description=c.get("description", ""),
            priority=int(c.get("priority", 0)),
            format=c.get("format", ""),
        )
        for c in columns
    )


def _conversion(crd_name: Any, strategy: Any) -> conversion.Converter | None:
    """The converter of a CRD whose ``spec.conversion`` is a webhook (the built-in one
    standing in for it), None for strategy None; a webhook with no built-in converter
    cannot be served (422), since no object could be read through another version."""
    if not isinstance(strategy, Mapping) or strategy.get("strategy", "None") == "None":
        return None
    convert = conversion.converter_for(str(crd_name))
    if strategy.get("strategy") != "Webhook" or convert is None:
        raise CrdError(
            "spec.conversion.strategy",
            f"Unsupported value: {strategy.get('strategy')!r}: the embedded API calls no "
            "conversion webhooks and has no built-in conversion for this CRD (it has one "
            f"for {', '.join(sorted(conversion.BUILT_IN))}); serve it with strategy None",
        )
    return convert


def _converted(
    api_version: str, schema: Mapping[str, Any] | None, convert: conversion.Converter | None
) -> Conversion:
    """An object at ``api_version``: converted by ``convert`` (a webhook's stand-in), or,
    for a CRD without a webhook (strategy None), with only ``apiVersion`` changed; read
    through a version (``schema``), pruned of what that version does not declare."""
    version = api_version.rpartition("/")[2]

    def converted(obj: Mapping[str, Any]) -> Obj:
        if convert is not None:
            out = convert(obj, version)
        else:
            out = dict(obj)
            out["apiVersion"] = api_version
        if schema is not None:
            out, _ = schemas.prune_and_default(out, schema)
        return out

    return converted


# ------------------------------------------------------------------ the registry

_VERSION = re.compile(r"^v(\d+)(?:(alpha|beta)(\d+))?$")


def version_priority(version: str) -> tuple[int, int, int, str]:
    """Kubernetes' order of versions: GA before beta before alpha, higher numbers first,
    anything else last (alphabetically). Smaller sorts first."""
    match = _VERSION.match(version)
    if match is None:
        return (3, 0, 0, version)
    stage = {None: 0, "beta": 1, "alpha": 2}[match.group(2)]
    return (stage, -int(match.group(1)), -int(match.group(3) or 0), version)


class ResourceRegistry:
    def __init__(self) -> None:
        self._served: dict[ResourceKey, ServedResource] = {}
        for resource in builtin_resources():
            self._served[resource.key] = resource

    def serve(self, resource: ServedResource) -> None:
        """Serve one more built-in (``authz`` adds its own)."""
        self._served[resource.key] = resource

    def __iter__(self) -> Iterator[ServedResource]:
        return iter(list(self._served.values()))

    def lookup(self, group: str, version: str, plural: str) -> ServedResource | None:
        return self._served.get((group, version, plural))

    def storage_of(self, resource: ServedResource) -> ServedResource:
        return self._served.get(resource.storage_key, resource)

    def served_by_crd(self, crd_name: str) -> list[ServedResource]:
        return [r for r in self._served.values() if r.crd_name == crd_name]

    def register_crd(self, crd: Mapping[str, Any]) -> list[ServedResource]:
        served = served_from_crd(crd)
        for resource in served:
            existing = self._served.get(resource.key)
            if existing is not None and existing.crd_name != resource.crd_name:
                raise CrdError(
                    "spec.names.plural",
                    f"Invalid value: {resource.plural!r}: {resource.group_resource} is already "
                    "served by another CRD",
                )
        self.unregister_crd(served[0].crd_name or "")
        for resource in served:
            self._served[resource.key] = resource
        return served

    def unregister_crd(self, crd_name: str) -> list[ServedResource]:
        gone = self.served_by_crd(crd_name)
        for resource in gone:
            del self._served[resource.key]
        return gone

    def groups(self) -> dict[str, list[str]]:
        """Group → versions, preferred version first; the core group is ``""``."""
        found: dict[str, list[str]] = {}
        for resource in self._served.values():
            versions = found.setdefault(resource.group, [])
            if resource.version not in versions:
                versions.append(resource.version)
        return {group: sorted(versions, key=version_priority) for group, versions in found.items()}

    def in_group_version(self, group: str, version: str) -> list[ServedResource]:
        return [r for r in self._served.values() if (r.group, r.version) == (group, version)]
