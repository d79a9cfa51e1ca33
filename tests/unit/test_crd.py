"""The names on the wire: ``orchestrator.operator.crd`` pins them, the CRD manifests
declare the same, the module stays importable by anything, and no other module in the
repository spells them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.operator import crd
from worker_agent.k8s_names import is_dns1035_label

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO / "deploy" / "crds"


@pytest.mark.parametrize(
    ("name", "wire"),
    [
        ("GROUP", "caliban.caliban-ai.dev"),
        ("VERSION", "v1alpha1"),
        ("API_VERSION", "caliban.caliban-ai.dev/v1alpha1"),
        ("PLURAL", "calibantasks"),
        ("KIND", "CalibanTask"),
        ("FINALIZER", "caliban.caliban-ai.dev/drain"),
        ("WAKE_ANNOTATION", "caliban.caliban-ai.dev/wake"),
        ("TASK_LABEL", "caliban.caliban-ai.dev/task"),
        ("CHECKPOINT_LABEL", "caliban.caliban-ai.dev/checkpoint"),
        ("KOPF_ANNOTATION_PREFIX", "caliban.caliban-ai.dev"),
        ("KOPF_DIFFBASE_KEY", "last-handled-configuration"),
        ("SANDBOX_GROUP", "agents.x-k8s.io"),
        ("SANDBOX_V1ALPHA1", "agents.x-k8s.io/v1alpha1"),
        ("SANDBOX_V1BETA1", "agents.x-k8s.io/v1beta1"),
        ("SANDBOX_API_VERSIONS", ("agents.x-k8s.io/v1alpha1", "agents.x-k8s.io/v1beta1")),
        ("SANDBOX_PLURAL", "sandboxes"),
        ("SANDBOX_KIND", "Sandbox"),
        ("SANDBOX_CRD", "sandboxes.agents.x-k8s.io"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_the_wire_names_are_what_stored_objects_and_users_rely_on(name: str, wire: Any) -> None:
    assert getattr(crd, name) == wire


def _manifest(file_name: str) -> dict[str, Any]:
    loaded = yaml.safe_load((CRDS / file_name).read_text())
    assert isinstance(loaded, dict)
    return loaded


def test_the_calibantask_crd_declares_the_same_names() -> None:
    manifest = _manifest("calibantask.yaml")
    spec = manifest["spec"]
    assert manifest["metadata"]["name"] == f"{crd.PLURAL}.{crd.GROUP}"
    assert spec["group"] == crd.GROUP
    assert spec["names"]["plural"] == crd.PLURAL
    assert spec["names"]["kind"] == crd.KIND
    storage = [v["name"] for v in spec["versions"] if v["storage"]]
    assert storage == [crd.VERSION]


def test_the_sandbox_crd_declares_the_same_names() -> None:
    manifest = yaml.safe_load(
        (REPO / "orchestrator" / "devcluster" / "crds" / "agent-sandbox"
         / "agents.x-k8s.io_sandboxes.yaml").read_text()
    )  # fmt: skip
    spec = manifest["spec"]
    assert manifest["metadata"]["name"] == crd.SANDBOX_CRD
    assert spec["group"] == crd.SANDBOX_GROUP
    assert spec["names"]["plural"] == crd.SANDBOX_PLURAL
    assert spec["names"]["kind"] == crd.SANDBOX_KIND
    served = {f"{spec['group']}/{v['name']}" for v in spec["versions"] if v["served"]}
    assert served == set(crd.SANDBOX_API_VERSIONS)


def test_the_names_module_imports_neither_kopf_nor_kubernetes_nor_the_ledger() -> None:
    probe = (
        "import sys, orchestrator.operator.crd\n"
        "heavy = {'kopf', 'kubernetes', 'sqlalchemy', 'celery'} & set(sys.modules)\n"
        "print(sorted(heavy))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


SPELLINGS = ("caliban.caliban-ai.dev", "agents.x-k8s.io", "calibantasks")
SOURCE_ROOTS = ("orchestrator", "worker_agent", "bench", "migrations")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose may name the values)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for statement in body:
                if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                    found.add(id(statement.value))
    return found


def _spellings_outside_crd() -> list[str]:
    hits: list[str] = []
    for root in SOURCE_ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            if path == REPO / "orchestrator" / "operator" / "crd.py":
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            prose = _docstrings(tree)
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and id(node) not in prose
                    and any(spelling in node.value for spelling in SPELLINGS)
                ):
                    hits.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    return hits


def test_no_module_but_crd_spells_the_api_names() -> None:
    assert _spellings_outside_crd() == []


@pytest.mark.parametrize(
    ("task", "existing", "name"),
    [("demo", None, "demo-sbx"), ("demo", "shared", "shared"), ("a-b", "", "a-b-sbx")],
)
def test_a_task_runs_in_its_own_sbx_sandbox_unless_it_names_an_existing_one(
    task: str, existing: str | None, name: str
) -> None:
    """caliban-operator's child naming: ``<task>-sbx``; ``spec.sandbox.name`` overrides."""
    assert crd.sandbox_name(task, existing) == name


@pytest.mark.parametrize(
    "task",
    [
        "a" * 60,  # <task>-sbx would be 64 characters
        "a" * 63,  # the longest name the CRD admits: 67
        "team.alpha",  # a dot: no Service name has one
        "7-days",  # a digit first: a DNS-1123 label, not a DNS-1035 one
        "x." + "b" * 60,
    ],
)
def test_a_task_whose_sbx_name_is_no_service_name_gets_a_sandbox_name_that_is(task: str) -> None:
    """agent-sandbox names a Sandbox's Service after it, so the Sandbox's name must be a
    DNS-1035 label. Tried: names ``<task>-sbx`` would make 64 and 67 characters long,
    dotted, and starting with a digit."""
    assert not is_dns1035_label(crd.upstream_sandbox_name(task))
    name = crd.sandbox_name(task)
    assert is_dns1035_label(name), name
    assert name.endswith("-sbx") and len(name) <= 63
    assert crd.sandbox_name(task) == name  # the same task, the same name, every time


def test_derived_sandbox_names_of_different_tasks_differ() -> None:
    """``team.alpha`` and ``team-alpha`` both make the stem ``team-alpha``: the hash of
    the task's own name keeps their Sandboxes apart, as are names cut at one length."""
    names = ["team.alpha", "team-alpha", "a" * 60, "a" * 61, "a" * 62, "a" * 63]
    assert len({crd.sandbox_name(n) for n in names}) == len(names)
    assert crd.sandbox_name("team-alpha") == "team-alpha-sbx"  # valid: as caliban-operator
