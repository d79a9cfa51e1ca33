"""Field ownership in the embedded Kubernetes API: ``metadata.managedFields`` and
server-side apply, with the semantics of structured-merge-diff (the library a real API
server uses).

An object's fields are named by paths of elements written as ``FieldsV1`` writes them:
``f:spec`` (a field), ``k:{"name":"c"}`` (an item of an associative list, by its keys),
``v:"x"`` (an item of a set-list). A :class:`Entry` is one manager's set of paths, recorded
by an ``Update`` (create, update, merge/JSON/strategic patch: the fields it changed) or an
``Apply`` (server-side apply: exactly the fields of its configuration).

How values nest is taken from a :class:`Shape`: a CRD's ``openAPIV3Schema`` where there
is one (``x-kubernetes-list-type``/``-list-map-keys``/``-map-type``; fields the schema does
not declare are deduced, as for ``x-kubernetes-preserve-unknown-fields``: maps merge, lists
are atomic), and for the built-ins and every object's ``metadata`` the merge-key table of
:mod:`~orchestrator.devcluster.patching` (containers by name, env by name, ...,
ownerReferences by uid), finalizers as a set, label selectors as atomic, and every other
list atomic. A list whose items do not all carry their keys is treated as atomic.

Pure functions; ``store`` calls :func:`updated` for every write and :func:`applied` for an
apply, and keeps the result in ``metadata.managedFields``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.devcluster.patching import MERGE_KEYS, MERGED_SETS

Path = tuple[str, ...]
FieldSet = frozenset[Path]
Ignored = Callable[[Path], bool]

APPLY = "Apply"
UPDATE = "Update"
BEFORE_FIRST_APPLY = "before-first-apply"
FIELDS_V1 = "FieldsV1"

# Built-in fields whose value is owned whole: LabelSelector and Service's selector map.
ATOMIC_FIELDS = frozenset({"selector", "podSelector", "namespaceSelector", "labelSelector"})

# Paths no manager owns: the server sets them (a real server's strip set).
_STRIPPED: frozenset[Path] = frozenset(
    {
        ("f:apiVersion",),
        ("f:kind",),
        ("f:metadata",),
        *(
            ("f:metadata", f"f:{name}")
            for name in (
                "name",
                "namespace",
                "creationTimestamp",
                "selfLink",
                "uid",
                "clusterName",
                "generation",
                "managedFields",
                "resourceVersion",
            )
        ),
    }
)
_STATUS: Path = ("f:status",)


# ------------------------------------------------------------------ shapes


@dataclass(frozen=True)
class Shape:
    """What is known of the type of a value at one place in an object: the schema node
    there (``typed``: a CRD's schema governs this part; its node may be ``None`` where the
    schema does not declare the field), or, untyped, the name of the field holding it."""

    schema: Mapping[str, Any] | None = None
    field: str | None = None
    typed: bool = False
    root: bool = False

    def member(self, key: str) -> tuple[Shape, bool]:
        """The shape of member ``key`` of a map, and whether it is a named field (a
        struct field) rather than an element of a map."""
        if key == "metadata" and (
            self.root or (self.schema or {}).get("x-kubernetes-embedded-resource")
        ):
            return Shape(field="metadata"), True
        if not self.typed:
            return Shape(field=key), True
        properties = (self.schema or {}).get("properties") or {}
        if key in properties:
            return Shape(properties[key], key, typed=True), True
        additional = (self.schema or {}).get("additionalProperties")
        if isinstance(additional, Mapping):
            return Shape(additional, key, typed=True), False
        return Shape(None, key, typed=True), False

    def item(self) -> Shape:
        if not self.typed:
            return Shape()
        items = (self.schema or {}).get("items")
        return Shape(items if isinstance(items, Mapping) else None, typed=True)

    def list_keys(self) -> tuple[str, ...] | None:
        """``None``: an atomic list; ``()``: a set; otherwise the keys of a map-list."""
        if self.typed:
            kind = (self.schema or {}).get("x-kubernetes-list-type")
            if kind == "set":
                return ()
            if kind == "map":
                keys = (self.schema or {}).get("x-kubernetes-list-map-keys") or []
                return tuple(str(k) for k in keys) or None
            return None
        if self.field in MERGED_SETS:
            return ()
        key = MERGE_KEYS.get(self.field or "")
        return (key,) if key else None

    def atomic_map(self) -> bool:
        if self.typed:
            return (self.schema or {}).get("x-kubernetes-map-type") == "atomic"
        return self.field in ATOMIC_FIELDS


def root_shape(schema: Mapping[str, Any] | None) -> Shape:
    """The shape of a whole object of a resource with this schema (``None``: a built-in)."""
    return Shape(schema, typed=schema is not None, root=True)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


Children = dict[str, tuple[Any, Shape, bool]]  # element → (value, shape, is a named field)


def _children(value: Any, shape: Shape) -> Children | None:
    """The members of a map or the items of a set- or map-list, by path element; ``None``
    for a leaf (a scalar, ``null``, an atomic list or map)."""
    if isinstance(value, Mapping):
        if shape.atomic_map():
            return None
        out: Children = {}
        for key, item in value.items():
            child, named = shape.member(str(key))
            out[f"f:{key}"] = (item, child, named)
        return out
    if isinstance(value, list):
        keys = shape.list_keys()
        if keys is None:
            return None
        items: Children = {}
        item_shape = shape.item()
        for item in value:
            if keys:
                if not isinstance(item, Mapping) or any(k not in item for k in keys):
                    return None
                element = "k:" + _compact({k: item[k] for k in keys})
            else:
                if isinstance(item, Mapping | list):
                    return None
                element = "v:" + _compact(item)
            if element in items:
                return None
            items[element] = (item, item_shape, False)
        return items
    return None


# ------------------------------------------------------------------ field sets


def field_set(obj: Any, shape: Shape) -> FieldSet:
    """The fields an apply configuration sets: every leaf (scalars, atomic lists and maps,
    empty maps and lists), every list item, and every map element."""
    paths: set[Path] = set()
    _collect(obj, shape, (), paths)
    return frozenset(paths)


def _collect(value: Any, shape: Shape, path: Path, out: set[Path]) -> None:
    children = _children(value, shape)
    if children is None or not children:
        if path:
            out.add(path)
        return
    for element, (child, child_shape, named) in children.items():
        child_path = (*path, element)
        _collect(child, child_shape, child_path, out)
        if not named:
            out.add(child_path)


def _nodes(value: Any, shape: Shape, path: Path, out: set[Path]) -> None:
    """Every path at or below ``path``, intermediate nodes included."""
    out.add(path)
    for element, (child, child_shape, _) in (_children(value, shape) or {}).items():
        _nodes(child, child_shape, (*path, element), out)


def closure(paths: Iterable[Path]) -> frozenset[Path]:
    """The paths and all their ancestors (the root excluded)."""
    out: set[Path] = set()
    for path in paths:
        for end in range(1, len(path) + 1):
            out.add(path[:end])
    return frozenset(out)


@dataclass(frozen=True)
class Comparison:
    added: FieldSet
    modified: FieldSet
    removed: FieldSet

    @property
    def changed(self) -> FieldSet:
        return self.added | self.modified


def compare(old: Any, new: Any, shape: Shape) -> Comparison:
    """What changed from ``old`` to ``new``: leaves added, modified or removed, and
    maps and list items that appeared or went."""
    added: set[Path] = set()
    modified: set[Path] = set()
    removed: set[Path] = set()

    def walk(before: Any, after: Any, node_shape: Shape, path: Path) -> None:
        left = None if before is None else _children(before, node_shape)
        right = None if after is None else _children(after, node_shape)
        leaf = (
            (before is not None and left is None)
            or (after is not None and right is None)
            or (not left and not right)
            or (before is not None and after is not None and type(before) is not type(after))
        )
        if leaf:
            if before is None and after is not None:
                added.add(path)
            elif after is None and before is not None:
                removed.add(path)
            elif before != after:
                modified.add(path)
            return
        left, right = left or {}, right or {}
        for element in {**left, **right}:
            old_child, child_shape, _ = left.get(element, (None, None, False))
            new_child, right_shape, _ = right.get(element, (None, None, False))
            walk(old_child, new_child, right_shape or child_shape or Shape(), (*path, element))
        if before is None:
            added.add(path)
        elif after is None:
            removed.add(path)

    walk(old, new, shape, ())
    return Comparison(
        frozenset(added - {()}), frozenset(modified - {()}), frozenset(removed - {()})
    )


# ------------------------------------------------------------------ merging and pruning


def merge(live: Any, config: Any, shape: Shape) -> Any:
    """``config`` merged onto ``live`` as server-side apply merges: maps member by member,
    map-lists item by key, set-lists as sets, anything atomic replaced by ``config``'s.
    A ``null`` in ``config`` removes the field."""
    left = None if live is None else _children(live, shape)
    right = _children(config, shape)
    if left is None or right is None or type(live) is not type(config):
        return _without_nulls(config)
    if isinstance(config, Mapping):
        result = dict(live)
        for key, value in config.items():
            if value is None:
                result.pop(key, None)
            elif key in result:
                result[key] = merge(result[key], value, shape.member(str(key))[0])
            else:
                result[key] = _without_nulls(value)
        return result
    return [
        merge(left[e][0], right[e][0], right[e][1]) if e in left and e in right else value
        for e, value in _merged_order(left, right)
    ]


def _merged_order(left: Children, right: Children) -> Iterator[tuple[str, Any]]:
    """The items of a merged list in structured-merge-diff's order: the live order, with
    the configuration's items in its own order where they are new."""
    lhs, rhs = list(left), list(right)
    shared = [e for e in rhs if e in left]
    next_shared = shared.pop(0) if shared else None
    taken: set[str] = set()
    li = ri = 0
    while li < len(lhs) or ri < len(rhs):
        if li < len(lhs) and lhs[li] in taken:
            li += 1
            continue
        if li < len(lhs) and ri < len(rhs):
            if lhs[li] == rhs[ri]:
                taken.add(lhs[li])
                yield lhs[li], None
                li, ri = li + 1, ri + 1
                next_shared = shared.pop(0) if shared else None
                continue
            if lhs[li] in right and next_shared is not None and next_shared != lhs[li]:
                li += 1
                continue
        if li < len(lhs) and lhs[li] not in right:
            yield lhs[li], copy.deepcopy(left[lhs[li]][0])
            li += 1
            continue
        if ri < len(rhs):
            element = rhs[ri]
            taken.add(element)
            yield element, _without_nulls(right[element][0])
            ri += 1
            if next_shared == element:
                next_shared = shared.pop(0) if shared else None
            continue
        li += 1


def _without_nulls(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def prune(obj: Any, shape: Shape, last: FieldSet, kept: FieldSet) -> Any:
    """``obj`` without the fields in ``last`` (what a manager applied before) that no one
    owns any more (``kept``: every manager's fields, the new configuration's included).
    A map or list item goes whole only when nothing in it is outside ``last``; what no
    manager ever set stays."""
    last_closure = closure(last)
    doomed = last_closure - closure(kept)
    if not doomed:
        return obj

    def walk(value: Any, node_shape: Shape, path: Path) -> Any:
        children = _children(value, node_shape)
        if not children:
            return value
        survivors: dict[str, Any] = {}
        for element, (child, child_shape, _) in children.items():
            child_path = (*path, element)
            if child_path in doomed:
                inside: set[Path] = set()
                _nodes(child, child_shape, child_path, inside)
                if child_path in last or inside <= last_closure:
                    continue
                child = walk(child, child_shape, child_path)
                if isinstance(child, Mapping | list) and not child:
                    continue
            elif child_path in last_closure:
                child = walk(child, child_shape, child_path)
            survivors[element] = child
        if isinstance(value, Mapping):
            return {element[2:]: child for element, child in survivors.items()}
        return list(survivors.values())

    return walk(obj, shape, ())


# ------------------------------------------------------------------ managedFields entries


@dataclass(frozen=True)
class Entry:
    """One element of ``metadata.managedFields``."""

    manager: str
    operation: str  # Apply | Update
    api_version: str
    time: str | None
    fields: FieldSet
    subresource: str = ""

    @property
    def identity(self) -> tuple[str, str, str, str]:
        """What a real server keys entries by: an applier has one entry whatever the
        version it applied through; an updater one per version."""
        version = "" if self.operation == APPLY else self.api_version
        return (self.manager, self.operation, self.subresource, version)

    def describe(self) -> str:
        """The manager as a conflict message names it."""
        text = json.dumps(self.manager)
        if self.subresource:
            text += f" with subresource {json.dumps(self.subresource)}"
        if self.operation == UPDATE:
            text += f" using {self.api_version}"
        return text

    def encode(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "manager": self.manager,
            "operation": self.operation,
            "apiVersion": self.api_version,
        }
        if self.time:
            out["time"] = self.time
        out["fieldsType"] = FIELDS_V1
        out["fieldsV1"] = to_fields_v1(self.fields)
        if self.subresource:
            out["subresource"] = self.subresource
        return out


def to_fields_v1(paths: Iterable[Path]) -> dict[str, Any]:
    """A set of paths as the nested ``fieldsV1`` object (``"."`` marks a node that is a
    member and has members below it)."""
    tree: dict[str, Any] = {}
    for path in paths:
        node = tree
        for element in path:
            node = node.setdefault(element, {})
        node["."] = {}

    def render(node: dict[str, Any]) -> dict[str, Any]:
        children = {k: render(v) for k, v in sorted(node.items()) if k != "."}
        if not children:
            return {}
        return {".": {}, **children} if "." in node else children

    return render(tree)


def from_fields_v1(tree: Mapping[str, Any], prefix: Path = ()) -> FieldSet:
    paths: set[Path] = set()
    for key, sub in tree.items():
        if key == ".":
            if prefix:
                paths.add(prefix)
            continue
        path = (*prefix, str(key))
        if not isinstance(sub, Mapping):
            raise ValueError(f"fieldsV1 at {path_text(path)} is not an object")
        if sub:
            paths |= from_fields_v1(sub, path)
        else:
            paths.add(path)
    return frozenset(paths)


def decode(raw: Any) -> list[Entry] | None:
    """``metadata.managedFields`` as entries; ``None`` when it is not a valid list of them."""
    if not isinstance(raw, list):
        return None
    entries = []
    for item in raw:
        if not isinstance(item, Mapping):
            return None
        fields = item.get("fieldsV1") or {}
        manager, operation = item.get("manager", ""), item.get("operation")
        if (
            item.get("fieldsType") != FIELDS_V1
            or operation not in (APPLY, UPDATE)
            or not isinstance(manager, str)
            or not isinstance(fields, Mapping)
        ):
            return None
        try:
            paths = from_fields_v1(fields)
        except ValueError:
            return None
        entries.append(
            Entry(
                manager=manager,
                operation=str(operation),
                api_version=str(item.get("apiVersion") or ""),
                time=str(item["time"]) if item.get("time") else None,
                fields=paths,
                subresource=str(item.get("subresource") or ""),
            )
        )
    return entries


def encode(entries: Iterable[Entry]) -> list[dict[str, Any]]:
    """The entries in a real server's order: appliers first, then by time and manager."""
    ordered = sorted(
        entries,
        key=lambda e: (e.operation, e.time or "", e.manager, e.api_version, e.subresource),
    )
    return [entry.encode() for entry in ordered]


def requested_entries(live: Any, sent: Any, *, subresource: str | None) -> list[Entry]:
    """The entries a write starts from: the live ones, unless the client sent a valid
    non-empty list (which replaces them) or ``[]``/``[{}]`` (which clears them); a write
    to a subresource never sets them."""
    if not subresource and sent is not None:
        if sent == [] or sent == [{}]:
            return []
        decoded = decode(sent)
        if decoded:
            return decoded
    return decode(live) or []


def ignored_paths(*, subresource: str | None, status_subresource: bool) -> Ignored:
    """The paths no write records: the server's own metadata; and the fields a write
    cannot change (``status`` through the object when it has a status subresource,
    everything but ``status`` through the subresource)."""

    def ignored(path: Path) -> bool:
        if path in _STRIPPED:
            return True
        if subresource == "status":
            return path[:1] != _STATUS
        return status_subresource and path[:1] == _STATUS

    return ignored


def path_text(path: Path) -> str:
    """A path as a real server prints it: ``.spec.containers[name="c"].image``."""
    out = []
    for element in path:
        kind, body = element[:2], element[2:]
        if kind == "f:":
            out.append(f".{body}")
        elif kind == "k:":
            keys = json.loads(body)
            out.append("[" + ",".join(f"{k}={_compact(v)}" for k, v in keys.items()) + "]")
        elif kind == "v:":
            out.append(f"[={body}]")
        else:
            out.append(f"[{body}]")
    return "".join(out)


class ApplyConflict(Exception):
    """Fields an apply would change that other managers own; the API answers 409."""

    def __init__(self, conflicts: list[tuple[Entry, Path]]) -> None:
        self.conflicts = sorted(conflicts, key=lambda c: (c[0].describe(), path_text(c[1])))
        super().__init__(self.message)

    @property
    def message(self) -> str:
        if len(self.conflicts) == 1:
            entry, path = self.conflicts[0]
            return (
                f"Apply failed with 1 conflict: conflict with {entry.describe()}: {path_text(path)}"
            )
        by_manager: dict[str, list[str]] = {}
        for entry, path in self.conflicts:
            by_manager.setdefault(entry.describe(), []).append(path_text(path))
        lines = []
        for manager in sorted(by_manager):
            lines.append(f"conflicts with {manager}:")
            lines.extend(f"- {path}" for path in by_manager[manager])
        return f"Apply failed with {len(self.conflicts)} conflicts: " + "\n".join(lines)

    def causes(self) -> list[dict[str, str]]:
        return [
            {
                "reason": "FieldManagerConflict",
                "message": f"conflict with {entry.describe()}",
                "field": path_text(path),
            }
            for entry, path in self.conflicts
        ]


def updated(
    entries: list[Entry],
    old: Any,
    new: Any,
    shape: Shape,
    *,
    manager: str,
    api_version: str,
    subresource: str | None,
    time: str,
    ignored: Ignored,
) -> list[Entry]:
    """The entries after a non-apply write from ``old`` to ``new`` by ``manager``: the
    fields it changed become its own (taken from any other manager), fields removed
    leave every manager."""
    diff = compare(old, new, shape)
    changed = frozenset(p for p in diff.changed if not ignored(p))
    removed = frozenset(p for p in diff.removed if not ignored(p))
    mine = Entry(manager, UPDATE, api_version, time, frozenset(), subresource or "")
    out: list[Entry] = []
    previous: Entry | None = None
    for entry in entries:
        if entry.identity == mine.identity:
            previous = entry
            continue
        kept = entry.fields - changed - removed
        if kept:
            out.append(_with_fields(entry, kept))
    if changed:
        before = previous.fields - removed if previous else frozenset()
        out.append(_with_fields(mine, before | changed))
    elif previous is not None and previous.fields - removed:
        out.append(_with_fields(previous, previous.fields - removed))
    return out


def applied(
    entries: list[Entry],
    live: Any,
    config: Mapping[str, Any],
    shape: Shape,
    *,
    manager: str,
    api_version: str,
    subresource: str | None,
    time: str,
    force: bool,
    ignored: Ignored,
) -> tuple[Any, list[Entry]]:
    """The object and entries after ``manager`` applies ``config`` to ``live``.

    The configuration's fields become the manager's Apply entry; fields it applied before
    and no longer sets are removed unless another manager owns them; a field it changes
    that another manager owns is a conflict (:class:`ApplyConflict`) unless ``force``
    takes it. An object no one owns anything of is first recorded as
    ``before-first-apply``'s, as a real server does."""
    if not entries:
        entries = updated(
            [],
            {},
            live,
            shape,
            manager=BEFORE_FIRST_APPLY,
            api_version=api_version,
            subresource=subresource,
            time=time,
            ignored=ignored,
        )
    config_fields = frozenset(p for p in field_set(config, shape) if not ignored(p))
    mine = Entry(manager, APPLY, api_version, time, config_fields, subresource or "")
    previous = next((e for e in entries if e.identity == mine.identity), None)
    others = [e for e in entries if e.identity != mine.identity]
    merged = merge(live, config, shape)
    if previous is not None:
        kept = config_fields.union(*(e.fields for e in others))
        merged = prune(merged, shape, previous.fields, kept)
    diff = compare(live, merged, shape)
    changed = frozenset(p for p in diff.changed if not ignored(p))
    removed = frozenset(p for p in diff.removed if not ignored(p))
    conflicts = [(entry, path) for entry in others for path in sorted(entry.fields & changed)]
    if conflicts and not force:
        raise ApplyConflict(conflicts)
    out = []
    for entry in others:
        kept_fields = entry.fields - changed - removed
        if kept_fields:
            out.append(_with_fields(entry, kept_fields))
    if merged == live and previous is not None:
        mine = Entry(manager, APPLY, api_version, previous.time, config_fields, mine.subresource)
    if config_fields:
        out.append(mine)
    return merged, out


def _with_fields(entry: Entry, fields: FieldSet) -> Entry:
    return Entry(
        entry.manager, entry.operation, entry.api_version, entry.time, fields, entry.subresource
    )
