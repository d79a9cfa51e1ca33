"""Label and field selectors of list and watch requests in the embedded Kubernetes API.

Label selectors take the set-based grammar kubectl and the client libraries send
(``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``, ``a notin (x,y)``, ``a``, ``!a``); field
selectors take ``path=value``, ``path==value`` and ``path!=value`` over any dotted path
(a real server allows a fixed set per resource; ``metadata.name``,
``metadata.namespace`` and the ``involvedObject.*`` fields of events are the ones used).
Pure parsing and matching; ``store`` applies them to lists and watch streams.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final


class SelectorError(ValueError):
    """A selector that does not parse; the API answers 400 BadRequest with its text."""


@dataclass(frozen=True)
class LabelRequirement:
    key: str
    operator: str  # = | != | in | notin | exists | !exists
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.operator == "exists":
            return present
        if self.operator == "!exists":
            return not present
        if self.operator in ("=", "in"):
            return present and value in self.values
        return not present or value not in self.values  # != and notin


@dataclass(frozen=True)
class FieldRequirement:
    path: str
    negated: bool
    value: str

    def matches(self, obj: Mapping[str, Any]) -> bool:
        actual = _field_value(obj, self.path)
        return (actual != self.value) if self.negated else (actual == self.value)


_SET_TERM = re.compile(r"^\s*([^\s!=(),]+)\s+(in|notin)\s*\(([^)]*)\)\s*$")
_EQUALITY_TERM = re.compile(r"^\s*([^\s!=(),]+)\s*(==|=|!=)\s*([^\s!=(),]*)\s*$")
_EXISTS_TERM = re.compile(r"^\s*(!?)\s*([^\s!=(),]+)\s*$")


def parse_label_selector(text: str | None) -> tuple[LabelRequirement, ...]:
    requirements = []
    for term in _split_terms(text or ""):
        if match := _SET_TERM.match(term):
            values = frozenset(v.strip() for v in match.group(3).split(",") if v.strip())
            requirements.append(LabelRequirement(match.group(1), match.group(2), values))
        elif match := _EQUALITY_TERM.match(term):
            operator = "!=" if match.group(2) == "!=" else "="
            requirements.append(
                LabelRequirement(match.group(1), operator, frozenset({match.group(3)}))
            )
        elif match := _EXISTS_TERM.match(term):
            operator = "!exists" if match.group(1) else "exists"
            requirements.append(LabelRequirement(match.group(2), operator))
        else:
            raise SelectorError(f"unable to parse requirement: {term.strip()!r}")
    return tuple(requirements)


def parse_field_selector(text: str | None) -> tuple[FieldRequirement, ...]:
    requirements = []
    for term in _split_terms(text or ""):
        match = _EQUALITY_TERM.match(term)
        if match is None:
            raise SelectorError(f"invalid field selector: {term.strip()!r}")
        requirements.append(
            FieldRequirement(match.group(1), match.group(2) == "!=", match.group(3))
        )
    return tuple(requirements)


def matches(
    obj: Mapping[str, Any],
    labels: tuple[LabelRequirement, ...],
    fields: tuple[FieldRequirement, ...],
) -> bool:
    object_labels = obj.get("metadata", {}).get("labels") or {}
    return all(r.matches(object_labels) for r in labels) and all(r.matches(obj) for r in fields)


def _split_terms(text: str) -> list[str]:
    """Commas separate terms, except inside the parentheses of ``in (a,b)``."""
    terms, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            terms.append(text[start:index])
            start = index + 1
    terms.append(text[start:])
    return [term for term in terms if term.strip()]


def _field_value(obj: Mapping[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return ""
        value = value.get(part)
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


TRUE_VALUES: Final = frozenset({"1", "t", "T", "true", "TRUE", "True"})
"""What the Kubernetes API reads as true in a query (Go's ``strconv.ParseBool``): the
Python client sends ``watch=True``, kubectl ``watch=true``."""


def is_watch(params: Mapping[str, str]) -> bool:
    """Whether a GET's query asks for a watch."""
    return params.get("watch") in TRUE_VALUES
