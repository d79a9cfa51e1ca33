"""Server-side printing for the embedded Kubernetes API: ``meta.k8s.io/v1`` Tables.

``kubectl get`` asks for ``application/json;as=Table`` and prints whatever columns the
server sends, so the columns of ``kubectl get ctask`` (Phase, Checkpoint, Age) come from
here: a CRD's ``additionalPrinterColumns`` (evaluated with the small JSONPath subset CRDs
use) or the fixed columns of a built-in resource. Pure functions of objects and a clock;
``emulator`` decides when a Table is wanted and ``resources`` says which columns exist.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Obj = Mapping[str, Any]
CellFn = Callable[[Obj, datetime.datetime], Any]


@dataclass(frozen=True)
class PrinterColumn:
    """One column: a CRD's ``jsonPath`` or, for built-ins, a computed cell."""

    name: str
    type: str = "string"  # string | integer | number | boolean | date
    json_path: str | None = None
    cell: CellFn | None = field(default=None, compare=False)
    description: str = ""
    priority: int = 0
    format: str = ""

    def definition(self) -> dict[str, Any]:
        # A "date" column is printed as an age, so kubectl gets it as a string.
        return {
            "name": self.name,
            "type": "string" if self.type == "date" else self.type,
            "format": self.format,
            "description": self.description,
            "priority": self.priority,
        }

    def render(self, obj: Obj, now: datetime.datetime) -> Any:
        if self.cell is not None:
            return self.cell(obj, now)
        if self.json_path is None:
            return None
        found = evaluate_json_path(obj, self.json_path)
        if not found:
            return None
        return _cell_for_json_value(self.type, found[0], now)


NAME_COLUMN = PrinterColumn(
    name="Name",
    format="name",
    description="Name must be unique within a namespace.",
    cell=lambda obj, now: obj.get("metadata", {}).get("name", ""),
)


def age_column(name: str = "Age") -> PrinterColumn:
    return PrinterColumn(
        name=name,
        type="date",
        json_path=".metadata.creationTimestamp",
        description="Time since the object was created.",
    )


def build_table(
    columns: Sequence[PrinterColumn],
    objects: Sequence[Obj],
    *,
    resource_version: str,
    include_object: str,
    with_headers: bool = True,
    now: datetime.datetime | None = None,
) -> dict[str, Any]:
    """A ``meta.k8s.io/v1`` Table; ``include_object`` is the request's ``includeObject``
    (``None``, ``Metadata`` — the default — or ``Object``)."""
    now = now or datetime.datetime.now(datetime.UTC)
    all_columns = [NAME_COLUMN, *columns]
    rows = []
    for obj in objects:
        row: dict[str, Any] = {"cells": [column.render(obj, now) for column in all_columns]}
        if include_object == "Object":
            row["object"] = obj
        elif include_object != "None":
            row["object"] = {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": obj.get("metadata", {}),
            }
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": [c.definition() for c in all_columns] if with_headers else [],
        "rows": rows,
    }


def human_duration(seconds: float) -> str:
    """How kubectl users expect an age: ``42s``, ``3m12s``, ``5h``, ``12d`` (the shape of
    Kubernetes' own ``HumanDuration``: more precision for short spans)."""
    if seconds < -1:
        return "<invalid>"
    secs = max(int(seconds), 0)
    if secs < 120:
        return f"{secs}s"
    minutes = secs // 60
    if minutes < 10:
        rest = secs % 60
        return f"{minutes}m{rest}s" if rest else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        rest = minutes % 60
        return f"{hours}h{rest}m" if rest else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    days = hours // 24
    if hours < 24 * 8:
        rest = hours % 24
        return f"{days}d{rest}h" if rest else f"{days}d"
    if days < 365 * 2:
        return f"{days}d"
    years, rest = divmod(days, 365)
    if years < 8:
        return f"{years}y{rest}d" if rest else f"{years}y"
    return f"{years}y"


def parse_timestamp(value: Any) -> datetime.datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.UTC)


def age_since(value: Any, now: datetime.datetime) -> str | None:
    when = parse_timestamp(value)
    return None if when is None else human_duration((now - when).total_seconds())


def _cell_for_json_value(column_type: str, value: Any, now: datetime.datetime) -> Any:
    if column_type == "date":
        return age_since(value, now) if isinstance(value, str) else None
    if column_type == "integer" and isinstance(value, int | float) and not isinstance(value, bool):
        return int(value)
    if column_type == "number" and isinstance(value, int | float) and not isinstance(value, bool):
        return value
    if column_type == "boolean" and isinstance(value, bool):
        return value
    if isinstance(value, str):
        return value
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


# ------------------------------------------------------------------ the JSONPath subset

_STEP = re.compile(
    r"""\.(?P<field>[A-Za-z0-9_$-]+)
      | \[(?P<index>-?\d+)\]
      | \[\*\]
      | \[\?\(@\.(?P<filter_field>[A-Za-z0-9_.-]+)\s*==\s*
           (?P<quote>["'])(?P<filter_value>.*?)(?P=quote)\)\]
      | \.\*""",
    re.VERBOSE,
)


def evaluate_json_path(obj: Any, path: str) -> list[Any]:
    """Evaluate a printer-column JSONPath: ``.a.b``, ``.list[0]``, ``.list[*].x``,
    ``.conditions[?(@.type=="Ready")].status``; braces (``{.a.b}``) are accepted.
    Returns every match (empty when the path leads nowhere)."""
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    if path.startswith("$"):
        path = path[1:]
    current: list[Any] = [obj]
    pos = 0
    while pos < len(path):
        step = _STEP.match(path, pos)
        if step is None:
            return []  # outside the subset: print nothing rather than guess
        pos = step.end()
        current = _apply_step(current, step)
    return current


def _apply_step(values: list[Any], step: re.Match[str]) -> list[Any]:
    out: list[Any] = []
    for value in values:
        if step.group("field") is not None:
            if isinstance(value, Mapping) and step.group("field") in value:
                out.append(value[step.group("field")])
        elif step.group("index") is not None:
            index = int(step.group("index"))
            if isinstance(value, list) and -len(value) <= index < len(value):
                out.append(value[index])
        elif step.group("filter_field") is not None:
            if isinstance(value, list):
                wanted = step.group("filter_value")
                for item in value:
                    found = evaluate_json_path(item, "." + step.group("filter_field"))
                    if found and str(found[0]) == wanted:
                        out.append(item)
        elif isinstance(value, list):
            out.extend(value)
        elif isinstance(value, Mapping):
            out.extend(value.values())
    return out
