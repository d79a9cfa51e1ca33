"""The PATCH bodies the embedded Kubernetes API accepts, applied to a stored object.

- ``application/merge-patch+json`` (RFC 7386): what kopf sends, and ``kubectl apply``,
  ``annotate`` and ``label`` for custom resources. Lists are replaced whole, which is how
  a patch of ``metadata.finalizers`` releases or adds a finalizer; ``null`` removes.
- ``application/json-patch+json`` (RFC 6902): ``kubectl patch --type json`` and kopf's
  transformations, with ``test`` failing the request.
- ``application/strategic-merge-patch+json``: what ``kubectl apply`` and ``kubectl
  patch`` send for built-in kinds. A real server takes merge keys from the Go types;
  here a table by field name covers the built-ins this API serves (containers, env,
  volumes, conditions, ownerReferences, ...), finalizers merge as a set, and the
  ``$patch``, ``$retainKeys``, ``$deleteFromPrimitiveList`` and ``$setElementOrder``
  directives are honoured (the last only by being dropped).
- ``application/apply-patch+yaml`` (server-side apply) is decoded here and applied by
  :mod:`~orchestrator.devcluster.managed_fields`: field managers, ``managedFields``,
  conflicts, and fields an applier stops setting removed. The merge-key table below is
  also what it merges the built-ins' lists by.

Pure functions; ``store`` calls :func:`apply_patch` and does the rest (status
subresource, resourceVersion, generation, managedFields).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import jsonpatch
import jsonpointer
import yaml

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
PATCH_TYPES = (MERGE_PATCH, JSON_PATCH, STRATEGIC_MERGE_PATCH, APPLY_PATCH)

# Lists merged by a key in strategic merge patches and server-side apply, by field name
# (see the module doc).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "envFrom": None,
    "ports": "containerPort",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "conditions": "type",
    "ownerReferences": "uid",
    "hostAliases": "ip",
}
# Lists of scalars merged as sets.
MERGED_SETS = frozenset({"finalizers"})


class PatchError(ValueError):
    """A patch that cannot apply; the API answers 422 (or 400 for a malformed body)."""


def decode_patch(content_type: str, text: str, data: Any) -> Any:
    """The patch body as data: JSON for the JSON types, YAML (a JSON superset) for apply."""
    if content_type == APPLY_PATCH:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PatchError(f"the apply configuration is not valid YAML: {exc}") from exc
    if data is None:
        raise PatchError("the patch body is not valid JSON")
    return data


def apply_patch(current: Mapping[str, Any], content_type: str, patch: Any) -> dict[str, Any]:
    """A new object; ``current`` is left untouched."""
    base = copy.deepcopy(dict(current))
    if content_type == JSON_PATCH:
        if not isinstance(patch, list):
            raise PatchError("a JSON patch must be a list of operations")
        try:
            result = jsonpatch.apply_patch(base, patch, in_place=False)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
            raise PatchError(f"the JSON patch cannot apply: {exc}") from exc
    elif not isinstance(patch, Mapping):
        raise PatchError(f"a {content_type} body must be a JSON object")
    elif content_type == STRATEGIC_MERGE_PATCH:
        result = strategic_merge(base, patch)
    elif content_type == MERGE_PATCH:
        result = merge_patch(base, patch)
    else:
        raise ValueError(f"{content_type} is applied by managed_fields.applied")
    if not isinstance(result, dict):
        raise PatchError("the patched object is not a JSON object")
    return result


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` removes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge(target: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: _without_directives(v) for k, v in patch.items() if not k.startswith("$")}
    if directive == "delete":
        return {}
    result = dict(target)
    deletions: dict[str, list[Any]] = {}
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            deletions[key.split("/", 1)[1]] = list(value or [])
            continue
        current = result.get(key)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, Mapping):
            if value.get("$patch") == "delete":
                result.pop(key, None)
            else:
                base = current if isinstance(current, Mapping) else {}
                result[key] = strategic_merge(base, value)
        elif isinstance(value, list) and key in MERGED_SETS and isinstance(current, list):
            result[key] = current + [v for v in value if v not in current]
        elif isinstance(value, list) and MERGE_KEYS.get(key) and isinstance(current, list):
            result[key] = _merge_keyed_list(current, value, MERGE_KEYS[key] or "")
        else:
            result[key] = _without_directives(value)
    for key, removed in deletions.items():
        if isinstance(result.get(key), list):
            result[key] = [v for v in result[key] if v not in removed]
    retained = patch.get("$retainKeys")
    if isinstance(retained, list):
        result = {k: v for k, v in result.items() if k in retained or k not in target}
    return result


def _merge_keyed_list(current: list[Any], patch: list[Any], merge_key: str) -> list[Any]:
    if any(isinstance(item, Mapping) and item.get("$patch") == "replace" for item in patch):
        return [
            _without_directives(i)
            for i in patch
            if not (isinstance(i, Mapping) and i.get("$patch") == "replace")
        ]
    result = list(current)
    for item in patch:
        if not isinstance(item, Mapping) or merge_key not in item:
            result.append(_without_directives(item))
            continue
        index = next(
            (
                i
                for i, old in enumerate(result)
                if isinstance(old, Mapping) and old.get(merge_key) == item[merge_key]
            ),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(_without_directives(item))
        else:
            result[index] = strategic_merge(result[index], item)
    return result


def _without_directives(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {
            k: _without_directives(v)
            for k, v in value.items()
            if not k.startswith("$") and v is not None
        }
    if isinstance(value, list):
        return [_without_directives(v) for v in value]
    return value
