"""What a CRD's ``openAPIV3Schema`` does to custom objects in the embedded API: pruning,
defaulting and validation, as a real API server does them.

The operator relies on all three: a default such as ``task.agents: 1`` must be present
when it reads a fresh CalibanTask, ``lifecycle.idleTimeout: banana`` must be refused with
a message naming the field, and a field one version of a CRD does not declare must not
show through that version. This covers the structural-schema keywords CRDs use (types,
``properties``, ``additionalProperties``, ``items``, ``required``, ``enum``, ``pattern``,
bounds, lengths, ``format`` for date-time and int32/int64, ``nullable``, ``default``,
``x-kubernetes-preserve-unknown-fields``, ``-int-or-string``, ``-embedded-resource``,
``-list-type``, and ``allOf``/``anyOf``/``oneOf``/``not``); CEL rules
(``x-kubernetes-validations``) are ``cel``'s, which ``store`` evaluates after these on
every write. Messages follow the API server's wording so ``kubectl`` prints what a user
would see from a cluster. Pure functions; ``store`` calls them on every write and
``resources`` on every read through a version.
"""

from __future__ import annotations

import copy
import datetime
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Schema = Mapping[str, Any]

# Top-level fields the API server owns; a CRD schema never prunes or validates them here.
_ROOT_FIELDS = ("apiVersion", "kind", "metadata")


@dataclass(frozen=True)
class FieldError:
    """One field-level problem, shaped like a ``StatusCause`` of a 422 ``Invalid``."""

    field: str
    reason: str  # FieldValueInvalid | FieldValueRequired | FieldValueNotSupported | ...
    detail: str  # what is wrong, without the field: ``Required value``

    @property
    def message(self) -> str:
        return f"{self.field}: {self.detail}"

    def cause(self) -> dict[str, str]:
        return {"reason": self.reason, "message": self.detail, "field": self.field}


def prune_and_default(obj: Mapping[str, Any], schema: Schema) -> tuple[dict[str, Any], list[str]]:
    """The object as the schema keeps it: unknown fields dropped, nulls of non-nullable
    fields dropped, defaults filled in. Also returns the dropped fields' paths (for
    ``fieldValidation=Strict|Warn``)."""
    unknown: list[str] = []
    result = _coerce(obj, schema, "", unknown, root=True)
    return (result if isinstance(result, dict) else dict(obj)), unknown


def validate(obj: Mapping[str, Any], schema: Schema) -> list[FieldError]:
    errors: list[FieldError] = []
    _validate(obj, schema, "", errors, root=True)
    return errors


# ------------------------------------------------------------------ pruning & defaulting


def _coerce(value: Any, schema: Schema, path: str, unknown: list[str], *, root: bool) -> Any:
    if isinstance(value, Mapping):
        return _coerce_object(value, schema, path, unknown, root=root)
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [
            _coerce(item, schema["items"], f"{path}[{i}]", unknown, root=False)
            for i, item in enumerate(value)
        ]
    return value


def _coerce_object(
    value: Mapping[str, Any], schema: Schema, path: str, unknown: list[str], *, root: bool
) -> dict[str, Any]:
    properties: Mapping[str, Schema] = schema.get("properties") or {}
    additional = schema.get("additionalProperties")
    keeps_unknown = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
    embedded = root or bool(schema.get("x-kubernetes-embedded-resource"))
    out: dict[str, Any] = {}
    for key, item in value.items():
        item_path = f"{path}.{key}" if path else key
        if embedded and key in _ROOT_FIELDS and key not in properties:
            out[key] = item
        elif embedded and key == "metadata":
            out[key] = item  # ObjectMeta is the server's, not the schema's
        elif key in properties:
            sub = properties[key]
            if item is None and not sub.get("nullable"):
                continue  # a null for a non-nullable field is dropped, as by the server
            out[key] = _coerce(item, sub, item_path, unknown, root=False)
        elif isinstance(additional, Mapping):
            if item is None and not additional.get("nullable"):
                continue
            out[key] = _coerce(item, additional, item_path, unknown, root=False)
        elif additional is True or keeps_unknown:
            out[key] = item
        else:
            unknown.append(item_path)
    for key, sub in properties.items():
        if key not in out and "default" in sub:
            default = copy.deepcopy(sub["default"])
            item_path = f"{path}.{key}" if path else key
            out[key] = _coerce(default, sub, item_path, unknown, root=False)
    return out


# ------------------------------------------------------------------ validation


def _validate(
    value: Any, schema: Schema, path: str, errors: list[FieldError], *, root: bool
) -> None:
    if value is None:
        if not schema.get("nullable") and schema.get("type"):
            errors.append(_type_error(path, value, schema["type"]))
        return
    if not _check_type(value, schema, path, errors):
        return
    _check_enum(value, schema, path, errors)
    if isinstance(value, str):
        _check_string(value, schema, path, errors)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        _check_number(value, schema, path, errors)
    elif isinstance(value, list):
        _check_array(value, schema, path, errors)
    elif isinstance(value, Mapping):
        _check_object(value, schema, path, errors, root=root)
    _check_combinators(value, schema, path, errors)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _type_error(path: str, value: Any, expected: str) -> FieldError:
    actual = _type_name(value)
    return FieldError(
        path,
        "FieldValueTypeInvalid",
        f'Invalid value: "{actual}": {path} in body must be of type {expected}: "{actual}"',
    )


def _check_type(value: Any, schema: Schema, path: str, errors: list[FieldError]) -> bool:
    if schema.get("x-kubernetes-int-or-string"):
        ok = isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            errors.append(_type_error(path, value, "integer or string"))
        return ok
    expected = schema.get("type")
    if not expected:
        return True
    ok = {
        "object": isinstance(value, Mapping),
        "array": isinstance(value, list),
        "string": isinstance(value, str),
        "boolean": isinstance(value, bool),
        "integer": (isinstance(value, int) and not isinstance(value, bool))
        or (isinstance(value, float) and value.is_integer()),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
    }.get(expected, True)
    if not ok:
        errors.append(_type_error(path, value, expected))
    return ok


def _check_enum(value: Any, schema: Schema, path: str, errors: list[FieldError]) -> None:
    allowed = schema.get("enum")
    if allowed is not None and value not in allowed:
        listed = ", ".join(json.dumps(a) for a in allowed)
        errors.append(
            FieldError(
                path,
                "FieldValueNotSupported",
                f"Unsupported value: {json.dumps(value)}: supported values: {listed}",
            )
        )


def _check_string(value: str, schema: Schema, path: str, errors: list[FieldError]) -> None:
    shown = json.dumps(value)
    pattern = schema.get("pattern")
    if pattern is not None and re.search(pattern, value) is None:
        errors.append(
            FieldError(
                path,
                "FieldValueInvalid",
                f"Invalid value: {shown}: {path} in body should match '{pattern}'",
            )
        )
    max_length = schema.get("maxLength")
    if max_length is not None and len(value) > max_length:
        errors.append(
            FieldError(
                path,
                "FieldValueTooLong",
                f"Too long: may not be more than {max_length} bytes",
            )
        )
    min_length = schema.get("minLength")
    if min_length is not None and len(value) < min_length:
        errors.append(
            FieldError(
                path,
                "FieldValueInvalid",
                f"Invalid value: {shown}: {path} in body should be at least "
                f"{min_length} chars long",
            )
        )
    if schema.get("format") == "date-time" and not _is_date_time(value):
        errors.append(
            FieldError(
                path,
                "FieldValueInvalid",
                f"Invalid value: {shown}: {path} in body must be of type date-time: {shown}",
            )
        )


def _is_date_time(value: str) -> bool:
    try:
        datetime.datetime.fromisoformat(value)
    except ValueError:
        return False
    return "T" in value.upper()


_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def _check_number(value: float, schema: Schema, path: str, errors: list[FieldError]) -> None:
    minimum = schema.get("minimum")
    if minimum is not None:
        exclusive = bool(schema.get("exclusiveMinimum"))
        if value < minimum or (exclusive and value == minimum):
            relation = "greater than" if exclusive else "greater than or equal to"
            errors.append(
                FieldError(
                    path,
                    "FieldValueInvalid",
                    f"Invalid value: {value}: {path} in body should be {relation} {minimum}",
                )
            )
    maximum = schema.get("maximum")
    if maximum is not None:
        exclusive = bool(schema.get("exclusiveMaximum"))
        if value > maximum or (exclusive and value == maximum):
            relation = "less than" if exclusive else "less than or equal to"
            errors.append(
                FieldError(
                    path,
                    "FieldValueInvalid",
                    f"Invalid value: {value}: {path} in body should be {relation} {maximum}",
                )
            )
    bounds = _INT_RANGES.get(schema.get("format", ""))
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        errors.append(
            FieldError(
                path,
                "FieldValueInvalid",
                f"Invalid value: {value}: {path} in body must be of type {schema['format']}",
            )
        )


def _check_array(value: list[Any], schema: Schema, path: str, errors: list[FieldError]) -> None:
    min_items = schema.get("minItems")
    if min_items is not None and len(value) < min_items:
        errors.append(
            FieldError(
                path,
                "FieldValueInvalid",
                f"Invalid value: {len(value)}: {path} in body should have at least "
                f"{min_items} items",
            )
        )
    max_items = schema.get("maxItems")
    if max_items is not None and len(value) > max_items:
        errors.append(
            FieldError(
                path,
                "FieldValueTooMany",
                f"Too many: {len(value)}: must have at most {max_items} items",
            )
        )
    items = schema.get("items")
    if isinstance(items, Mapping):
        for index, item in enumerate(value):
            _validate(item, items, f"{path}[{index}]", errors, root=False)
    list_type = schema.get("x-kubernetes-list-type")
    if list_type in ("set", "map"):
        keys = schema.get("x-kubernetes-list-map-keys") or []
        seen: list[Any] = []
        for index, item in enumerate(value):
            identity = (
                [item.get(k) for k in keys]
                if list_type == "map" and isinstance(item, Mapping)
                else item
            )
            if identity in seen:
                errors.append(
                    FieldError(
                        f"{path}[{index}]",
                        "FieldValueDuplicate",
                        f"Duplicate value: {json.dumps(item)}",
                    )
                )
            seen.append(identity)


def _check_object(
    value: Mapping[str, Any], schema: Schema, path: str, errors: list[FieldError], *, root: bool
) -> None:
    embedded = root or bool(schema.get("x-kubernetes-embedded-resource"))
    for key in schema.get("required") or []:
        if key not in value or value[key] is None:
            item_path = f"{path}.{key}" if path else key
            errors.append(FieldError(item_path, "FieldValueRequired", "Required value"))
    properties: Mapping[str, Schema] = schema.get("properties") or {}
    additional = schema.get("additionalProperties")
    for key, item in value.items():
        if embedded and key in _ROOT_FIELDS:
            continue
        item_path = f"{path}.{key}" if path else key
        if key in properties:
            _validate(item, properties[key], item_path, errors, root=False)
        elif isinstance(additional, Mapping):
            _validate(item, additional, item_path, errors, root=False)
    for bound, compare, words in (
        ("minProperties", int.__lt__, "at least"),
        ("maxProperties", int.__gt__, "at most"),
    ):
        limit = schema.get(bound)
        if limit is not None and compare(len(value), limit):
            errors.append(
                FieldError(
                    path,
                    "FieldValueInvalid",
                    f"Invalid value: {len(value)}: {path} in body should have {words} "
                    f"{limit} properties",
                )
            )


def _check_combinators(value: Any, schema: Schema, path: str, errors: list[FieldError]) -> None:
    def passes(sub: Schema) -> bool:
        found: list[FieldError] = []
        _validate(value, sub, path, found, root=False)
        return not found

    for sub in schema.get("allOf") or []:
        _validate(value, sub, path, errors, root=False)
    any_of = schema.get("anyOf")
    if any_of and not any(passes(sub) for sub in any_of):
        errors.append(
            FieldError(
                path,
                "FieldValueInvalid",
                f"Invalid value: {json.dumps(value)}: "
                f"{path} in body must match at least one schema in anyOf",
            )
        )
    one_of = schema.get("oneOf")
    if one_of and sum(passes(sub) for sub in one_of) != 1:
        errors.append(
            FieldError(
                path,
                "FieldValueInvalid",
                f"Invalid value: {json.dumps(value)}: "
                f"{path} in body must match exactly one schema in oneOf",
            )
        )
    negated = schema.get("not")
    if isinstance(negated, Mapping) and passes(negated):
        errors.append(
            FieldError(
                path,
                "FieldValueInvalid",
                f"Invalid value: {json.dumps(value)}: "
                f"{path} in body should not be valid against the schema",
            )
        )
