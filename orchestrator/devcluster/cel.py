"""CEL validation rules (``x-kubernetes-validations``) of CRD schemas in the embedded API,
compiled and evaluated by cel-python (``celpy``) where a real API server uses cel-go.

Two moments, as on a cluster. When a CRD is written, :func:`check_crd` compiles every
rule and ``messageExpression`` of every version's schema and refuses the CRD (422) if one
does not parse, calls a function celpy does not have, names a variable other than
``self``, ``oldSelf`` and a macro's own, has an unknown ``reason`` or a ``fieldPath`` the
schema does not have, stands under ``allOf``/``anyOf``/``oneOf``/``not``, or uses
``oldSelf`` where no old value can be correlated (under the items of a list that is not
``x-kubernetes-list-type: map``). So a rule the embedded API accepted is a rule it
evaluates. When an object is written, :func:`validate` evaluates the rules on the pruned
and defaulted object: ``self`` is the node's value (objects as maps whose property names
are escaped as cel-go escapes them, integers as int64, ``date-time``, ``duration`` and
``byte`` strings as timestamp, duration and bytes); a transition rule (one naming
``oldSelf``) only on an update and only where the old object has a value at the node,
list items correlated by their ``x-kubernetes-list-map-keys`` and map values by key.
An update is ratcheted, as the API server ratchets it: a node it leaves as it was is not
held to its rules again. A failure is a
:class:`~orchestrator.devcluster.schema.FieldError` worded as the API server words it
(``spec.x: Invalid value: "string": <message>``); an evaluation error fails the rule
with the error in the message. Programs are cached by their text and a schema's
compiled rules by the schema, so a CRD's rules are compiled once; ``store`` calls both
functions.
"""

from __future__ import annotations

import base64
import collections
import functools
import json
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import celpy
from celpy import celtypes
from celpy.adapter import json_to_cel
from celpy.celparser import CELParseError
from celpy.evaluation import CELEvalError, base_functions

from orchestrator.devcluster.schema import FieldError, Schema

REASONS = ("FieldValueDuplicate", "FieldValueForbidden", "FieldValueInvalid", "FieldValueRequired")
"""The ``reason`` values a rule may give its failure."""

NOT_CHECKED = FieldError(
    "<nil>",
    "FieldValueInvalid",
    'Invalid value: "null": some validation rules were not checked because the object was '
    "invalid; correct the existing errors to complete validation",
)
"""What the API server says instead of evaluating rules on an object whose type or enum
errors would make them meaningless."""

_BLOCKING = ("FieldValueTypeInvalid", "FieldValueNotSupported")
_COMPREHENSIONS = frozenset({"all", "exists", "exists_one", "map", "filter"})
_MACROS = _COMPREHENSIONS | {"has", "dyn"}
_FUNCTIONS = frozenset(name for name in base_functions if name.isidentifier()) | {"min"}
_TYPE_NAMES = frozenset(
    {"bool", "bytes", "double", "duration", "int", "list", "map", "null_type", "string"}
    | {"timestamp", "type", "uint"}
)
_VARIABLES = frozenset({"self", "oldSelf"})
_RESERVED = frozenset(
    {"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for"}
    | {"function", "if", "import", "let", "loop", "package", "namespace", "return", "var"}
    | {"void", "while"}
)
_ESCAPES = (("__", "__underscores__"), (".", "__dot__"), ("-", "__dash__"), ("/", "__slash__"))
_FIELD_PATH_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_-]*)|\['([^']*)'\]")
_ROOT_METADATA = ("name", "generateName")


class _Absent:
    """No old value at a node: a create, or a field the old object did not have."""


_ABSENT = _Absent()


# ------------------------------------------------------------------ compiling


@dataclass(frozen=True)
class _Program:
    """One CEL expression, compiled; ``error`` says why it is not (``runner`` is None)."""

    runner: celpy.Runner | None
    error: str | None
    uses_old_self: bool


@dataclass(frozen=True)
class _Rule:
    rule: str
    program: _Program
    message: str
    message_expression: _Program | None
    reason: str
    field_path: str  # relative to the node, rendered: "", ".a.b", "[key]"


@dataclass(frozen=True)
class _Node:
    """A schema node with rules at or below it; subtrees without rules are left out."""

    schema: Schema
    rules: tuple[_Rule, ...]
    properties: Mapping[str, _Node]
    additional: _Node | None
    items: _Node | None


_compile_lock = threading.Lock()


@functools.cache
def _environment() -> celpy.Environment:
    return celpy.Environment()


@functools.lru_cache(maxsize=4096)
def _compile(text: str) -> _Program:
    with _compile_lock:
        try:
            ast = _environment().compile(text)
        except CELParseError as exc:
            where = f"<input>:{exc.line}:{exc.column}" if exc.line else "<input>"
            return _Program(None, f"ERROR: {where}: Syntax error", False)
        problem = _undeclared(ast)
        if problem is not None:
            return _Program(None, problem, False)
        uses_old_self = any(
            tree.data == "ident" and _name(tree, 0) == "oldSelf" for tree in ast.iter_subtrees()
        )
        return _Program(_environment().program(ast), None, uses_old_self)


def _name(tree: celpy.Expression[Any], index: int) -> str:
    """The identifier at ``index`` among a parse-tree node's children (a token), or ""."""
    token = tree.children[index] if len(tree.children) > index else None
    return token if isinstance(token, str) else ""


def _undeclared(ast: celpy.Expression[Any]) -> str | None:
    """Why the expression refers to something celpy would not find, or None."""
    bound: set[str] = set()
    for tree in ast.iter_subtrees():
        if tree.data == "member_dot_arg" and _name(tree, 1) in _COMPREHENSIONS:
            args = tree.children[2] if len(tree.children) > 2 else None
            if isinstance(args, celpy.Expression) and args.children:
                first = args.children[0]
                if isinstance(first, celpy.Expression):
                    idents = [t for t in first.iter_subtrees() if t.data == "ident"]
                    if idents:
                        bound.add(_name(idents[0], 0))
    for tree in ast.iter_subtrees():
        if tree.data in ("ident_arg", "dot_ident_arg", "member_dot_arg"):
            name = _name(tree, 1 if tree.data == "member_dot_arg" else 0)
            if name not in _MACROS and name not in _FUNCTIONS:
                return (
                    f"ERROR: <input>: undeclared reference to '{name}' (in container ''): "
                    "the embedded API's CEL (cel-python) has no such function"
                )
        elif tree.data in ("ident", "dot_ident"):
            name = _name(tree, 0)
            if name not in _VARIABLES and name not in bound and name not in _TYPE_NAMES:
                return f"ERROR: <input>: undeclared reference to '{name}' (in container '')"
    return None


def check_crd(crd: Mapping[str, Any]) -> list[FieldError]:
    """What is wrong with the rules of a CRD's schemas (empty: every rule compiles and
    will be evaluated), as causes of the CRD's 422."""
    problems: list[FieldError] = []
    versions = (crd.get("spec") or {}).get("versions") or []
    for index, version in enumerate(versions):
        if not isinstance(version, Mapping):
            continue
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if isinstance(schema, Mapping):
            where = f"spec.versions[{index}].schema.openAPIV3Schema"
            found: list[FieldError] = []
            node = _build(schema, where, found, None)
            if not found:
                _remember(schema, node)
            problems += found
    return problems


def _build(
    schema: Schema, where: str, problems: list[FieldError], uncorrelatable: str | None
) -> _Node | None:
    rules: list[_Rule] = []
    for index, raw in enumerate(schema.get("x-kubernetes-validations") or []):
        rule = _rule(raw, schema, f"{where}.x-kubernetes-validations[{index}]", problems)
        if rule is not None:
            if rule.program.uses_old_self and uncorrelatable is not None:
                problems.append(
                    FieldError(
                        f"{where}.x-kubernetes-validations[{index}].rule",
                        "FieldValueInvalid",
                        f"Invalid value: {json.dumps(rule.rule)}: oldSelf cannot be used on "
                        f"the uncorrelatable portion of the schema within {uncorrelatable}",
                    )
                )
            rules.append(rule)
    for junctor in ("allOf", "anyOf", "oneOf"):
        for index, sub in enumerate(schema.get(junctor) or []):
            _forbid_rules(sub, f"{where}.{junctor}[{index}]", problems)
    _forbid_rules(schema.get("not"), f"{where}.not", problems)
    properties: dict[str, _Node] = {}
    for key, sub in (schema.get("properties") or {}).items():
        if isinstance(sub, Mapping):
            node = _build(sub, f"{where}.properties[{key}]", problems, uncorrelatable)
            if node is not None:
                properties[key] = node
    additional = schema.get("additionalProperties")
    additional_node = (
        _build(additional, f"{where}.additionalProperties", problems, uncorrelatable)
        if isinstance(additional, Mapping)
        else None
    )
    items = schema.get("items")
    items_node = None
    if isinstance(items, Mapping):
        correlated = schema.get("x-kubernetes-list-type") == "map"
        items_where = f"{where}.items"
        items_node = _build(
            items, items_where, problems, uncorrelatable if correlated else uncorrelatable or where
        )
    if not (rules or properties or additional_node or items_node):
        return None
    return _Node(schema, tuple(rules), properties, additional_node, items_node)


def _forbid_rules(schema: Any, where: str, problems: list[FieldError]) -> None:
    if not isinstance(schema, Mapping):
        return
    if schema.get("x-kubernetes-validations"):
        problems.append(
            FieldError(
                f"{where}.x-kubernetes-validations",
                "FieldValueForbidden",
                "Forbidden: the embedded API evaluates rules only outside allOf, anyOf, oneOf "
                "and not",
            )
        )
    for key in ("properties", "additionalProperties", "items", "allOf", "anyOf", "oneOf", "not"):
        value = schema.get(key)
        if key == "properties" and isinstance(value, Mapping):
            for name, sub in value.items():
                _forbid_rules(sub, f"{where}.properties[{name}]", problems)
        elif isinstance(value, list):
            for index, sub in enumerate(value):
                _forbid_rules(sub, f"{where}.{key}[{index}]", problems)
        else:
            _forbid_rules(value, f"{where}.{key}", problems)


def _rule(raw: Any, schema: Schema, where: str, problems: list[FieldError]) -> _Rule | None:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("rule"), str) or not raw["rule"]:
        problems.append(FieldError(f"{where}.rule", "FieldValueRequired", "Required value"))
        return None
    text = raw["rule"]
    ok = True
    program = _compile(text)
    if program.error is not None:
        problems.append(_invalid(f"{where}.rule", text, f"compilation failed: {program.error}"))
        ok = False
    message = raw.get("message")
    if message is not None and (not isinstance(message, str) or not message.strip()):
        problems.append(_invalid(f"{where}.message", message, "message must be non-empty"))
        ok = False
    elif isinstance(message, str) and ("\n" in message or "\r" in message):
        problems.append(
            _invalid(f"{where}.message", message, "message must not contain line breaks")
        )
        ok = False
    expression = raw.get("messageExpression")
    message_program = None
    if expression is not None:
        message_program = _compile(str(expression))
        if message_program.error is not None:
            problems.append(
                _invalid(
                    f"{where}.messageExpression",
                    expression,
                    f"messageExpression compilation failed: {message_program.error}",
                )
            )
            ok = False
    reason = raw.get("reason") or "FieldValueInvalid"
    if reason not in REASONS:
        listed = ", ".join(json.dumps(r) for r in REASONS)
        problems.append(
            FieldError(
                f"{where}.reason",
                "FieldValueNotSupported",
                f"Unsupported value: {json.dumps(reason)}: supported values: {listed}",
            )
        )
        ok = False
    field_path = ""
    if raw.get("fieldPath"):
        resolved = _field_path(str(raw["fieldPath"]), schema)
        if resolved is None:
            problems.append(
                _invalid(
                    f"{where}.fieldPath",
                    raw["fieldPath"],
                    "fieldPath must be a path to a field of the schema, of .name and "
                    "['name'] steps",
                )
            )
            ok = False
        else:
            field_path = resolved
    if not ok:
        return None
    shown = message.strip() if isinstance(message, str) else f"failed rule: {text.strip()}"
    return _Rule(text, program, shown, message_program, reason, field_path)


def _invalid(field: str, value: Any, detail: str) -> FieldError:
    return FieldError(field, "FieldValueInvalid", f"Invalid value: {json.dumps(value)}: {detail}")


def _field_path(path: str, schema: Schema) -> str | None:
    """``fieldPath`` rendered as the field path it names below the node, or None if it is
    not a path into the schema."""
    rendered, position, node = "", 0, schema
    while position < len(path):
        step = _FIELD_PATH_STEP.match(path, position)
        if step is None:
            return None
        name = step.group(1) if step.group(1) is not None else step.group(2)
        properties = node.get("properties") or {}
        additional = node.get("additionalProperties")
        if name in properties:
            node, rendered = properties[name], f"{rendered}.{name}"
        elif isinstance(additional, Mapping):
            node, rendered = additional, f"{rendered}[{name}]"
        else:
            return None
        position = step.end()
    return rendered or None


_schemas: collections.OrderedDict[int, tuple[Schema, _Node | None]] = collections.OrderedDict()
_schemas_lock = threading.Lock()
_SCHEMAS_KEPT = 256


def _remember(schema: Schema, node: _Node | None) -> None:
    with _schemas_lock:
        _schemas[id(schema)] = (schema, node)  # the schema held, so its id is not reused
        _schemas.move_to_end(id(schema))
        while len(_schemas) > _SCHEMAS_KEPT:
            _schemas.popitem(last=False)


def _compiled(schema: Schema) -> _Node | None:
    with _schemas_lock:
        hit = _schemas.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    node = _build(schema, "", [], None)
    _remember(schema, node)
    return node


# ------------------------------------------------------------------ evaluating


def validate(
    obj: Mapping[str, Any],
    schema: Schema,
    old: Mapping[str, Any] | None = None,
    *,
    prior: Sequence[FieldError] = (),
) -> list[FieldError]:
    """The rules ``obj`` fails; ``old`` is the object it replaces (None on a create) and
    ``prior`` the schema's own errors: a type or enum error among them stops the rules
    from being evaluated, with the API server's notice saying so."""
    node = _compiled(schema)
    if node is None:
        return []
    if any(problem.reason in _BLOCKING for problem in prior):
        return [NOT_CHECKED]
    errors: list[FieldError] = []
    _evaluate(node, obj, _ABSENT if old is None else old, "", errors)
    return errors


def _evaluate(node: _Node, value: Any, old: Any, path: str, errors: list[FieldError]) -> None:
    if value is None:
        return
    if not isinstance(old, _Absent) and value == old:
        # Ratcheting, as the API server does it: what an update leaves as it was is not
        # held to the rules again (a status write never re-evaluates the spec's). A
        # transition rule over an unchanged value (``self == oldSelf``) holds anyway.
        return
    if node.rules:
        this = _to_cel(_root_view(value) if not path else value, node.schema)
        has_old = not isinstance(old, _Absent) and old is not None
        previous = _to_cel(_root_view(old) if not path else old, node.schema) if has_old else None
        for rule in node.rules:
            if rule.program.uses_old_self and not has_old:
                continue
            error = _check(rule, node.schema, this, previous, path)
            if error is not None:
                errors.append(error)
    if isinstance(value, Mapping):
        properties = node.schema.get("properties") or {}
        olds = old if isinstance(old, Mapping) else {}
        for key, item in value.items():
            if key in properties:
                child, item_path = node.properties.get(key), f"{path}.{key}" if path else key
            else:
                child, item_path = node.additional, f"{path}[{key}]"
            if child is not None:
                _evaluate(child, item, olds.get(key, _ABSENT), item_path, errors)
    elif isinstance(value, list) and node.items is not None:
        keys = node.schema.get("x-kubernetes-list-map-keys") or []
        correlated: dict[str, Any] = {}
        if node.schema.get("x-kubernetes-list-type") == "map" and isinstance(old, list):
            correlated = {_identity(item, keys): item for item in old}
        for index, item in enumerate(value):
            previous_item = correlated.get(_identity(item, keys), _ABSENT)
            _evaluate(node.items, item, previous_item, f"{path}[{index}]", errors)


def _identity(item: Any, keys: Sequence[str]) -> str:
    found = [item.get(key) for key in keys] if isinstance(item, Mapping) else [item]
    return json.dumps(found, sort_keys=True)


def _root_view(obj: Any) -> Any:
    """The object as a root rule sees it: of ``metadata`` only the name fields."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("metadata"), Mapping):
        return obj
    meta = obj["metadata"]
    return {**obj, "metadata": {k: meta[k] for k in _ROOT_METADATA if k in meta}}


def _check(rule: _Rule, schema: Schema, this: Any, previous: Any, path: str) -> FieldError | None:
    assert rule.program.runner is not None
    activation: dict[str, Any] = {"self": this}
    if rule.program.uses_old_self:
        activation["oldSelf"] = previous
    type_name = json.dumps(str(schema.get("type") or ""))
    field = path or "<nil>"
    result: Any
    try:
        result = rule.program.runner.evaluate(activation)
    except CELEvalError as exc:
        result = exc
    if isinstance(result, CELEvalError):
        text = result.args[0] if result.args else str(result)
        return FieldError(
            field,
            "FieldValueInvalid",
            f"Invalid value: {type_name}: {text} evaluating rule: {rule.rule.strip()}",
        )
    if not isinstance(result, celtypes.BoolType):
        return FieldError(
            field,
            "FieldValueInvalid",
            f"Invalid value: {type_name}: rule evaluated to {type(result).__name__}, not "
            f"bool: {rule.rule.strip()}",
        )
    if result:
        return None
    field = (path + rule.field_path).lstrip(".") if rule.field_path else field
    message = _message(rule, activation)
    if rule.reason == "FieldValueForbidden":
        return FieldError(field, rule.reason, f"Forbidden: {message}")
    if rule.reason == "FieldValueRequired":
        return FieldError(field, rule.reason, f"Required value: {message}")
    if rule.reason == "FieldValueDuplicate":
        return FieldError(field, rule.reason, f"Duplicate value: {type_name}")
    return FieldError(field, "FieldValueInvalid", f"Invalid value: {type_name}: {message}")


def _message(rule: _Rule, activation: Mapping[str, Any]) -> str:
    """The ``messageExpression``'s string if it gives a usable one, else the message."""
    program = rule.message_expression
    if program is None or program.runner is None:
        return rule.message
    try:
        result = program.runner.evaluate(dict(activation))
    except CELEvalError:
        return rule.message
    if isinstance(result, str) and result.strip() and "\n" not in result:
        return str(result)
    return rule.message


def _to_cel(value: Any, schema: Schema) -> Any:
    """A JSON value as CEL sees it through its schema."""
    if value is None:
        return None
    kind = schema.get("type")
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, int):
        return celtypes.DoubleType(value) if kind == "number" else celtypes.IntType(value)
    if isinstance(value, float):
        if kind == "integer" and value.is_integer():
            return celtypes.IntType(int(value))
        return celtypes.DoubleType(value)
    if isinstance(value, str):
        return _string(value, schema.get("format"))
    if isinstance(value, list):
        items = schema.get("items")
        items_schema: Schema = items if isinstance(items, Mapping) else {}
        return celtypes.ListType([_to_cel(item, items_schema) for item in value])
    if isinstance(value, Mapping):
        properties: Mapping[str, Schema] = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        other: Schema = additional if isinstance(additional, Mapping) else {}
        return celtypes.MapType(
            {
                celtypes.StringType(_escape(key) if key in properties else key): _to_cel(
                    item, properties.get(key, other)
                )
                for key, item in value.items()
            }
        )
    return json_to_cel(value)


def _string(value: str, format_: Any) -> Any:
    try:
        if format_ == "date-time":
            return celtypes.TimestampType(value)
        if format_ == "duration":
            return celtypes.DurationType(value)
        if format_ == "byte":
            return celtypes.BytesType(base64.b64decode(value, validate=True))
    except (ValueError, TypeError):
        pass
    return celtypes.StringType(value)


def _escape(name: str) -> str:
    """A property name as a CEL field name (cel-go's escaping for Kubernetes)."""
    if name in _RESERVED:
        return f"__{name}__"
    for raw, escaped in _ESCAPES:
        name = name.replace(raw, escaped)
    return name
