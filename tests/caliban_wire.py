"""Upstream caliban's golden wire vectors (``tests/fixtures/caliban-wire``), and a shape
check: whether a message of ours has every field an upstream one has, with a value of
the same JSON type, so upstream's serde types read it (extra fields are ignored)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

VECTORS = Path(__file__).parent / "fixtures" / "caliban-wire"


@cache
def vectors(file: str) -> tuple[dict[str, Any], ...]:
    """The entries of one vectors file: ``{"name", "type", "json", …}`` each."""
    lines = (VECTORS / file).read_text().splitlines()
    return tuple(json.loads(line) for line in lines if line.strip())


def _type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number" if isinstance(value, float) else "int"
    return type(value).__name__


def shape_mismatches(ours: Any, upstream: Any, path: str = "$") -> list[str]:
    """Where ``ours`` would not read as upstream's ``upstream`` does: a missing field or a
    value of another JSON type (null on either side matches anything: an Option)."""
    if ours is None or upstream is None:
        return []
    if _type(ours) != _type(upstream):
        return [f"{path}: ours is {_type(ours)}, upstream's is {_type(upstream)}"]
    if isinstance(upstream, dict):
        found = []
        for key, value in upstream.items():
            if key not in ours:
                found.append(f"{path}.{key}: missing")
            else:
                found += shape_mismatches(ours[key], value, f"{path}.{key}")
        return found
    if isinstance(upstream, list) and upstream and ours:
        return shape_mismatches(ours[0], upstream[0], f"{path}[0]")
    return []


def reply_vector(kind: str, **match: Any) -> dict[str, Any]:
    """An upstream reply vector of ``kind`` (and, for errors, of ``error_kind``)."""
    for entry in vectors("replies.jsonl"):
        doc = entry["json"]
        if doc["kind"] != kind:
            continue
        if "error_kind" in match and doc["error"]["kind"] != match["error_kind"]:
            continue
        if kind == "listed" and not doc["agents"]:
            continue
        return dict(doc)
    raise LookupError(f"no upstream reply vector of kind {kind!r} {match or ''}")
