"""Our CalibanTask CRD is a superset of caliban-operator's, checked against upstream's own
files (``tests/fixtures/upstream``), not an imitation of them.

An object stored under caliban-operator's CRD must keep validating when ours replaces it
(same name, so installing one replaces the other), and keep its meaning: nothing it says
is pruned away. The objects tried are upstream's sample (its hosts rewritten to
127.0.0.1) and variants generated from upstream's ``openAPIV3Schema``: for every field,
values of every shape its schema admits (null where nullable, empty, short, long and
enum-free strings such as ``Checkpoint`` and ``1d``, lists with repeated entries). Each
is checked valid under upstream's schema first (both with the embedded API's structural
validator and with ``jsonschema``), then admitted under ours the way the embedded API
server admits a write (``orchestrator.devcluster.schema``: prune, default, validate).

Where upstream admits a value this operator cannot honour, ours admits it too and the
operator refuses it (``parse_spec`` raises ``SpecError`` naming the field, which becomes
condition SpecValid False and a Warning event); the tests pin which fields those are.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from orchestrator.devcluster import schema as structural
from orchestrator.operator import crd
from orchestrator.operator.lifecycle import MAX_PROMPT_BYTES, SpecError, parse_spec
from tests import upstream
from tests.unit.test_crd_schema import CRD_PATH, errors, load_yaml, openapi_schema

Schema = dict[str, Any]

UPSTREAM_TASK_SCHEMA = openapi_schema(load_yaml(upstream.CALIBANTASK_CRD), "v1alpha1")
OUR_TASK_SCHEMA = openapi_schema(load_yaml(CRD_PATH), "v1alpha1")
UPSTREAM_WORKSPACE_SCHEMA = openapi_schema(load_yaml(upstream.WORKSPACE_CRD), "v1alpha1")

# Values upstream admits that this operator refuses, by field: the schema takes them (as
# upstream's does) and ``parse_spec`` names the field (docs/operator.md's table).
OPERATOR_REFUSES = {
    "lifecycle.onDelete", "lifecycle.idleTimeout", "task.prompt", "workspaceRef.name",
}  # fmt: skip

LONG = 70_000  # longer than our CRD's old 64 KiB prompt limit, within what the daemon takes
STRING_SHAPES = ["", "x", "Checkpoint", "Delete", "1d", "30m", "has spaces", "ünï/cødé", "y" * LONG]


# --- generating what upstream's schema admits ----------------------------------------


def minimal(node: Schema) -> Any:
    """The smallest value valid under ``node``: required fields only."""
    kind = str(node.get("type"))
    if "enum" in node:
        return node["enum"][0]
    if kind == "object":
        props = node.get("properties", {})
        return {name: minimal(props[name]) for name in node.get("required", [])}
    if kind == "array":
        return [minimal(node["items"]) for _ in range(node.get("minItems", 0))]
    if kind == "string":
        return "x" * max(1, node.get("minLength", 0))
    return {"integer": 1, "number": 1.5, "boolean": True}[kind]


def variants(node: Schema) -> Iterator[Any]:
    """Values of every shape ``node`` admits; for an object, its minimal value with each
    property in turn set to each of its own variants (so every field, at any depth)."""
    if node.get("nullable"):
        yield None
    kind = node.get("type")
    if "enum" in node:
        yield from node["enum"]
    elif kind == "string":
        yield from (s for s in STRING_SHAPES if len(s) >= node.get("minLength", 0))
    elif kind in ("integer", "number"):
        yield from (0, 1, 7, 2**40)
    elif kind == "boolean":
        yield from (True, False)
    elif kind == "array":
        if not node.get("minItems"):
            yield []
        items = list(variants(node["items"]))
        yield from ([item] for item in items if item is not None)
        yield [items[-1], items[-1]]  # a repeated entry
    elif kind == "object":
        base = minimal(node)
        yield base
        for name, sub in node.get("properties", {}).items():
            for value in variants(sub):
                yield {**copy.deepcopy(base), name: value}


def task(spec: Any = None, status: Any = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "caliban.caliban-ai.dev/v1alpha1",
        "kind": "CalibanTask",
        "metadata": {"name": "t", "namespace": "team-a"},
        "spec": minimal(UPSTREAM_TASK_SCHEMA["properties"]["spec"]) if spec is None else spec,
    }
    if status is not None:
        obj["status"] = status
    return obj


def described(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 120 else f"{text[:100]}…({len(text)} chars)"


def generated() -> Iterator[Any]:
    props = UPSTREAM_TASK_SCHEMA["properties"]
    for spec in variants(props["spec"]):
        yield pytest.param(task(spec=spec), id=f"spec={described(spec)}")
    for status in variants(props["status"]):
        if status is not None:
            yield pytest.param(task(status=status), id=f"status={described(status)}")


# --- admitting under a schema, as the embedded API server does -----------------------


def admitted(obj: dict[str, Any], schema: Schema) -> dict[str, Any]:
    """``obj`` as the API server stores it under ``schema``; fails on what it refuses
    (invalid, or a field the schema does not know: kubectl's default is Strict)."""
    pruned, unknown = structural.prune_and_default(obj, schema)
    assert unknown == [], f"unknown fields {unknown}"
    problems = structural.validate(pruned, schema)
    assert problems == [], [p.message for p in problems]
    return pruned


def leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every scalar (and empty container) of a stored object, with its path."""
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif isinstance(value, list) and value:
        for index, item in enumerate(value):
            yield from leaves(item, (*path, index))
    else:
        yield path, value


_MISSING = object()


def body(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` without apiVersion, kind and metadata: the API server's, which a CRD's
    schema need not declare (upstream's does not), so ``jsonschema`` checks the rest."""
    return {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}


def at(value: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        in_dict = isinstance(value, dict) and part in value
        in_list = isinstance(value, list) and isinstance(part, int) and part < len(value)
        if not (in_dict or in_list):
            return _MISSING
        value = value[part]
    return value


def assert_same_meaning(
    obj: dict[str, Any], upstreams: Schema = UPSTREAM_TASK_SCHEMA, our: Schema = OUR_TASK_SCHEMA
) -> dict[str, Any]:
    """Valid under upstream's schema ``upstreams`` (checked), admitted under ``our``, and
    every value the user wrote that upstream keeps is kept by ours unchanged (a null
    means unset in both: upstream keeps it as null, ours may prune it); returns the
    object as ours stores it. The CalibanTask's schemas unless told."""
    assert not errors(upstreams, body(obj)), "not valid under upstream's schema"
    theirs = admitted(obj, upstreams)
    ours = admitted(obj, our)
    assert not errors(our, ours)
    for path, value in leaves(theirs):
        if value is None or at(obj, path) is _MISSING:
            continue  # a null (unset), or upstream's own default (phase, conditions)
        kept = at(ours, path)
        where = ".".join(map(str, path))
        if value == {}:  # ours may fill in defaults of its own fields inside
            assert isinstance(kept, dict), f"{where} lost"
        else:
            assert kept == value, f"{where} lost or changed"
    return ours


# --- upstream's files ----------------------------------------------------------------


def test_every_upstream_file_is_named_in_the_readme() -> None:
    readme = (upstream.UPSTREAM / "README.md").read_text()
    files = sorted(
        str(p.relative_to(upstream.UPSTREAM))
        for p in upstream.UPSTREAM.rglob("*")
        if p.is_file() and p.name != "README.md"
    )
    assert len(files) == 8
    assert [f for f in files if f"`{f}`" not in readme] == []


def test_a_task_s_sandbox_is_named_as_caliban_operator_names_it() -> None:
    """Tried: upstream's own rule, read from its source (``sandbox_name`` formats the
    task's name with a suffix), and its own test's example task and Sandbox name:
    ``crd.upstream_sandbox_name`` (what a task given upstream's Sandbox looks for) and
    ``crd.sandbox_name`` (what the operator makes) agree with both."""
    source = upstream.NAMES_SOURCE.read_text()
    rule = re.search(
        r"pub fn sandbox_name\(t: &CalibanTask\) -> String \{\s*"
        r'format!\("\{\}(?P<suffix>[^"{}]*)", t\.name_any\(\)\)',
        source,
    )
    assert rule is not None, "upstream's sandbox_name is no longer the task's name + a suffix"
    task = re.search(r'CalibanTask::new\(\s*"(?P<name>[^"]+)"', source)
    example = re.search(r'assert_eq!\(sandbox_name\(&t\), "(?P<name>[^"]+)"\);', source)
    assert task is not None and example is not None, "upstream's names test is gone"
    assert (task["name"], rule["suffix"], example["name"]) == (
        "refactor-auth", "-sbx", "refactor-auth-sbx"
    )  # fmt: skip
    for name in (task["name"], "a", "x" * 59):
        assert crd.upstream_sandbox_name(name) == name + rule["suffix"]
        assert crd.sandbox_name(name) == name + rule["suffix"]
    assert crd.upstream_sandbox_name(task["name"]) == example["name"]


_IPV4 = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}\b")
_SCP = re.compile(r"^[^@/\s]+@([^:/\s]+):")


def hosts(manifest: Any) -> set[str]:
    """Every host a manifest names: in URLs, scp-like git remotes, or bare IPv4s."""
    found: set[str] = set()
    for text in upstream.strings(manifest):
        if "://" in text and urlsplit(text).hostname:
            found.add(str(urlsplit(text).hostname))
        if scp := _SCP.match(text):
            found.add(scp[1])
        found.update(_IPV4.findall(text))
    return found


def test_the_samples_as_shipped_name_hosts_off_this_machine() -> None:
    raw = [upstream.load(p) for p in sorted(upstream.SAMPLES.glob("*.yaml"))]
    assert set().union(*map(hosts, raw)) == {"example", "192.168.1.240"}


def test_rewritten_samples_name_no_host_but_this_machine() -> None:
    samples = upstream.local_samples()
    assert sorted(samples) == ["calibantask.yaml", "workspace.yaml"]
    named = set().union(*map(hosts, samples.values()))
    assert named == {"127.0.0.1"}
    assert named <= {"127.0.0.1", "localhost"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("git@example:caliban", "git@127.0.0.1:caliban"),
        ("http://192.168.1.240:11434", "http://127.0.0.1:11434"),
        ("https://user@git.example.com/org/repo.git", "https://user@127.0.0.1/org/repo.git"),
        ("ssh://git@example.com:2222/repo", "ssh://git@127.0.0.1:2222/repo"),
        ("refactor the auth module", "refactor the auth module"),
        ("/work/caliban", "/work/caliban"),
    ],
)
def test_localize_rewrites_only_hosts(text: str, expected: str) -> None:
    assert upstream.localize(text) == expected


def test_upstream_sample_task_is_admitted_and_keeps_its_meaning() -> None:
    sample = upstream.local_samples()["calibantask.yaml"]
    ours = assert_same_meaning(sample)
    assert ours["spec"]["workspaceRef"] == {"name": "team-a-ws"}
    assert ours["spec"]["providerRef"] == "workers"
    parsed = parse_spec(ours["spec"])
    assert (parsed.prompt, parsed.on_delete, parsed.agents) == (
        "refactor the auth module",
        "checkpoint",
        1,
    )


def test_upstream_sample_workspace_is_valid_under_upstream_workspace_crd() -> None:
    sample = upstream.local_samples()["workspace.yaml"]
    assert not errors(UPSTREAM_WORKSPACE_SCHEMA, body(sample))
    assert admitted(sample, UPSTREAM_WORKSPACE_SCHEMA)["spec"] == sample["spec"]


# --- every field of upstream's schema ------------------------------------------------


def declared_fields(schema: Schema) -> set[tuple[str, ...]]:
    """Every property path of ``schema`` (a list's items add no step)."""
    declared: set[tuple[str, ...]] = set()

    def walk(node: Schema, path: tuple[str, ...]) -> None:
        for name, sub in node.get("properties", {}).items():
            declared.add((*path, name))
            walk(sub, (*path, name))
        if isinstance(node.get("items"), dict):
            walk(node["items"], path)

    walk(schema, ())
    return declared


def reached_fields(objects: Iterable[Any]) -> set[tuple[str, ...]]:
    """Every property path some of ``objects`` sets."""
    reached: set[tuple[str, ...]] = set()
    for obj in objects:
        for path, _ in leaves(obj):
            names = tuple(p for p in path if isinstance(p, str))
            reached.update(names[:i] for i in range(1, len(names) + 1))
    return reached


def test_the_generator_reaches_every_field_of_upstream_schema() -> None:
    """Not vacuous: every property path of upstream's schema is set by some variant."""
    declared = declared_fields(UPSTREAM_TASK_SCHEMA)
    assert declared - reached_fields(p.values[0] for p in generated()) == set()
    assert len(declared) > 40


@pytest.mark.parametrize("obj", list(generated()))
def test_what_upstream_admits_ours_admits_with_the_same_meaning(obj: dict[str, Any]) -> None:
    ours = assert_same_meaning(obj)
    refused = refusal(ours["spec"])
    assert refused is None or refused.field in OPERATOR_REFUSES, str(refused)


def refusal(spec: dict[str, Any]) -> SpecError | None:
    """What the operator says of ``spec``: None if it runs it, else its refusal."""
    try:
        parse_spec(spec)
    except SpecError as refused:
        return refused
    return None


# --- what the operator makes of upstream's values ------------------------------------


def spec_with(**lifecycle: Any) -> dict[str, Any]:
    obj = task(spec={"workspaceRef": {"name": "ws"}, "task": {"prompt": "p"},
                     "lifecycle": lifecycle})  # fmt: skip
    spec: dict[str, Any] = admitted(obj, OUR_TASK_SCHEMA)["spec"]
    return spec


@pytest.mark.parametrize(
    ("written", "meaning"),
    [
        ("Checkpoint", "checkpoint"),
        ("CHECKPOINT", "checkpoint"),
        ("checkpoint", "checkpoint"),
        ("Delete", "delete"),
        ("delete", "delete"),
        (None, "checkpoint"),
    ],
)
def test_on_delete_in_any_case_means_checkpoint_or_delete(written: Any, meaning: str) -> None:
    assert parse_spec(spec_with(onDelete=written)).on_delete == meaning


@pytest.mark.parametrize(
    ("written", "secs"),
    [("1d", 86_400.0), ("2d12h", 216_000.0), ("30m", 1_800.0), (None, None)],
)
def test_idle_timeout_takes_days(written: Any, secs: float | None) -> None:
    assert parse_spec(spec_with(idleTimeout=written)).idle_timeout_secs == secs


@pytest.mark.parametrize(
    ("lifecycle", "field", "reason"),
    [
        ({"onDelete": "maybe"}, "lifecycle.onDelete", "InvalidLifecycleOnDelete"),
        ({"onDelete": ""}, "lifecycle.onDelete", "InvalidLifecycleOnDelete"),
        ({"idleTimeout": "a while"}, "lifecycle.idleTimeout", "InvalidLifecycleIdleTimeout"),
        ({"idleTimeout": ""}, "lifecycle.idleTimeout", "InvalidLifecycleIdleTimeout"),
    ],
)
def test_values_upstream_admits_and_we_cannot_honour_are_refused_by_the_operator(
    lifecycle: dict[str, str], field: str, reason: str
) -> None:
    spec = spec_with(**lifecycle)  # admitted by the schema
    with pytest.raises(SpecError) as refused:
        parse_spec(spec)
    assert (refused.value.field, refused.value.reason) == (field, reason)
    assert str(refused.value).startswith(f"spec.{field}: ")


def test_a_prompt_the_daemon_can_pass_on_is_accepted_and_a_longer_one_refused() -> None:
    fits = "é" * (MAX_PROMPT_BYTES // 2)  # two bytes each: the limit is in bytes
    base = {"workspaceRef": {"name": "ws"}}
    assert parse_spec(admitted(task(spec={**base, "task": {"prompt": fits}}), OUR_TASK_SCHEMA)[
        "spec"]).prompt == fits  # fmt: skip
    too_long = admitted(task(spec={**base, "task": {"prompt": fits + "éé"}}), OUR_TASK_SCHEMA)
    with pytest.raises(SpecError) as refused:
        parse_spec(too_long["spec"])
    assert refused.value.field == "task.prompt"
    assert f"{MAX_PROMPT_BYTES} bytes" in str(refused.value)


def exec_with_prompt(size: int) -> str:
    """Start a process the way the daemon starts an agent with a prompt of ``size``
    bytes (one argument and the environment entry): ``ok`` or the OS's refusal."""
    prompt = "p" * size
    try:
        subprocess.run([sys.executable, "-c", "pass", prompt], check=True,
                       env={"CALIBAN_INITIAL_PROMPT": prompt})  # fmt: skip
    except OSError as exc:
        return type(exc).__name__ + f": {exc.strerror}"
    return "ok"


def test_max_prompt_bytes_is_what_linux_lets_a_process_start_with() -> None:
    assert (exec_with_prompt(MAX_PROMPT_BYTES), exec_with_prompt(MAX_PROMPT_BYTES + 1)) == (
        "ok",
        "OSError: Argument list too long",
    )
