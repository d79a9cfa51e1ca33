"""The import rules of docs/architecture.md, checked over the source's import graph.

Every module under ``worker_agent/``, ``orchestrator/`` and ``migrations/`` is parsed
with ``ast`` (nothing is imported, so the check needs no server and no optional
dependency). Every import statement counts, wherever it stands: at module level, inside
a function (the CLI imports each command's needs when it runs), under ``TYPE_CHECKING``.
``from package import name`` counts as an import of ``package.name`` too, since ``name``
may be a submodule, and importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``
first, so a module's closure includes its parent packages.

The rules:

- dependencies between the halves and the orchestrator's packages run one way (table
  :data:`FORBIDDEN`), and only the CLI, the demo and the testing kit may reach the
  embedded Kubernetes API;
- the daemon side (every ``worker_agent`` module and what it reaches) and the CLI at
  start-up (its module-level imports, which ``drainctl daemon`` runs in a Sandbox pod)
  need neither kopf, Flower, kmock nor SQLAlchemy;
- third-party imports match ``pyproject.toml``: outside ``orchestrator/devcluster`` only
  runtime dependencies, inside it also the ``dev`` extra.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIRST_PARTY = ("worker_agent", "orchestrator", "migrations")

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "worker_agent": ("orchestrator",),
    "orchestrator.ledger": (
        "orchestrator.operator",
        "orchestrator.pipeline",
        "orchestrator.cli",
        "orchestrator.devcluster",
    ),
    "orchestrator.pipeline": (
        "orchestrator.operator",
        "orchestrator.cli",
        "orchestrator.devcluster",
    ),
    "orchestrator.operator": ("orchestrator.cli", "orchestrator.devcluster"),
    "orchestrator.audit": (
        "orchestrator.pipeline",
        "orchestrator.cli",
        "orchestrator.devcluster",
        "orchestrator.operator.handlers",
        "orchestrator.operator.main",
    ),
}
"""Importer package → the packages it must never import (``a.b`` covers ``a.b.*``)."""

DEVCLUSTER_USERS = (
    "orchestrator.devcluster",
    "orchestrator.cli",
    "orchestrator.demo",
    "orchestrator.testing",
)
"""The only modules (and packages) that may import ``orchestrator.devcluster``."""

KNOWN_VIOLATIONS: frozenset[tuple[str, str]] = frozenset()
"""(importer, imported) edges that break a rule today and are tolerated, each with why.
An entry that no longer matches an edge fails the test, so the list only shrinks."""

NOT_ON_THE_DAEMON_SIDE = ("kopf", "flower", "kmock", "sqlalchemy")
"""Top-level names the daemon pod does not have to install."""


@dataclass(frozen=True)
class Import:
    """One imported module name, where it was written and whether at module level."""

    importer: str
    name: str
    line: int
    module_level: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    """Every first-party module (packages by their ``__init__``), by dotted name."""
    modules: dict[str, Path] = {}
    for top in FIRST_PARTY:
        for path in sorted((REPO / top).rglob("*.py")):
            modules[module_name(path)] = path
    return modules


def _absolute(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name of ``from {'.' * level}{module} import …`` written in ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    drop = level - 1 if is_package else level
    anchor = base[: len(base) - drop] if drop else base
    return ".".join([*anchor, module] if module else anchor)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, path: Path) -> Iterator[Import]:
    """Every module name an import statement in ``path`` may load."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    module_level = {id(statement) for statement in tree.body}
    # A statement nested in `if`/`try` at module level still runs at import time; one
    # under `if TYPE_CHECKING:` never runs (only type checkers read it).
    for statement in tree.body:
        if isinstance(statement, ast.If) and _is_type_checking(statement.test):
            module_level.discard(id(statement))
            module_level |= {id(child) for s in statement.orelse for child in ast.walk(s)}
        elif isinstance(statement, ast.If | ast.Try):
            module_level |= {id(child) for child in ast.walk(statement)}
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        top = id(node) in module_level
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(name, alias.name, node.lineno, top)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, is_package, node.level, node.module)
            if base == "__future__":
                continue
            yield Import(name, base, node.lineno, top)
            for alias in node.names:
                if alias.name != "*":
                    yield Import(name, f"{base}.{alias.name}", node.lineno, top)


def is_within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def first_party_target(name: str, modules: dict[str, Path]) -> str | None:
    """The first-party module an imported name loads (``pkg.attr`` → ``pkg``), if any."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def parents(name: str) -> Iterator[str]:
    parts = name.split(".")
    for i in range(1, len(parts)):
        yield ".".join(parts[:i])


@dataclass(frozen=True)
class Graph:
    modules: dict[str, Path]
    imports: dict[str, list[Import]]

    @classmethod
    def of_source(cls) -> Graph:
        modules = source_modules()
        return cls(modules, {name: list(imports_of(name, p)) for name, p in modules.items()})

    def edges(self) -> Iterator[tuple[Import, str]]:
        """(import, the first-party module it loads) for every first-party import."""
        for found in self.imports.values():
            for imp in found:
                target = first_party_target(imp.name, self.modules)
                if target is not None and target != imp.importer:
                    yield imp, target

    def closure(self, roots: Iterable[str], *, module_level_only: bool = False) -> set[str]:
        """The first-party modules that importing ``roots`` may run."""
        seen: set[str] = set()
        todo = list(roots)
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            todo.extend(p for p in parents(current) if p in self.modules)
            for imp in self.imports.get(current, []):
                if module_level_only and not imp.module_level:
                    continue
                target = first_party_target(imp.name, self.modules)
                if target is not None:
                    todo.append(target)
        return seen

    def third_party(self, modules: Iterable[str], *, module_level_only: bool = False) -> set[str]:
        """Top-level third-party names imported by ``modules`` themselves."""
        names: set[str] = set()
        for module in modules:
            for imp in self.imports[module]:
                if module_level_only and not imp.module_level:
                    continue
                top = imp.name.split(".")[0]
                if top not in FIRST_PARTY and top not in sys.stdlib_module_names:
                    names.add(top)
        return names


@pytest.fixture(scope="module")
def graph() -> Graph:
    return Graph.of_source()


def violations(graph: Graph) -> set[tuple[str, str, int]]:
    """(importer, imported module, line) for every import that breaks a package rule."""
    found: set[tuple[str, str, int]] = set()
    for imp, target in graph.edges():
        for importer_package, forbidden in FORBIDDEN.items():
            if is_within(imp.importer, importer_package) and any(
                is_within(target, f) for f in forbidden
            ):
                found.add((imp.importer, target, imp.line))
        if is_within(target, "orchestrator.devcluster") and not any(
            is_within(imp.importer, user) for user in DEVCLUSTER_USERS
        ):
            found.add((imp.importer, target, imp.line))
    return found


def test_the_graph_sees_every_package_and_function_local_imports(graph: Graph) -> None:
    for package in (
        "worker_agent",
        "orchestrator.operator",
        "orchestrator.pipeline",
        "orchestrator.ledger",
        "orchestrator.cli",
        "orchestrator.devcluster",
    ):
        assert package in graph.modules
    # `drainctl dev up` imports the embedded API inside the command's function.
    cli = graph.imports["orchestrator.cli.dev"]
    assert any(imp.name == "orchestrator.devcluster.up" and not imp.module_level for imp in cli), (
        "function-local imports must be part of the graph"
    )


def test_dependencies_between_packages_run_one_way(graph: Graph) -> None:
    broken = {
        (importer, target, line)
        for importer, target, line in violations(graph)
        if (importer, target) not in KNOWN_VIOLATIONS
    }
    assert not broken, "imports that break the rules of docs/architecture.md:\n" + "\n".join(
        f"  {graph.modules[i].relative_to(REPO)}:{line}: {i} imports {t}"
        for i, t, line in sorted(broken)
    )


def test_every_tolerated_violation_still_exists(graph: Graph) -> None:
    present = {(importer, target) for importer, target, _ in violations(graph)}
    assert present >= KNOWN_VIOLATIONS, (
        f"fixed, so delete from KNOWN_VIOLATIONS: {sorted(KNOWN_VIOLATIONS - present)}"
    )


def test_the_rules_catch_a_function_local_forbidden_import(graph: Graph, tmp_path: Path) -> None:
    """The checker itself: a ledger module that imports the operator inside a function
    is reported, with its line."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f() -> None:\n    from orchestrator.operator import handlers\n")
    name = "orchestrator.ledger.bad"
    found = violations(
        Graph({**graph.modules, name: bad}, {**graph.imports, name: list(imports_of(name, bad))})
    )
    assert (name, "orchestrator.operator.handlers", 2) in found


def test_the_daemon_side_needs_neither_kopf_flower_kmock_nor_sqlalchemy(graph: Graph) -> None:
    daemon = graph.closure(m for m in graph.modules if is_within(m, "worker_agent"))
    needed = graph.third_party(daemon) & set(NOT_ON_THE_DAEMON_SIDE)
    assert not needed, f"the daemon side imports {sorted(needed)} (through {sorted(daemon)})"


def test_drainctl_starts_without_kopf_flower_kmock_or_sqlalchemy(graph: Graph) -> None:
    """Each command imports what it needs when it runs, so ``drainctl daemon`` in a
    Sandbox pod loads none of the operator's or the ledger's libraries."""
    start_up = graph.closure(["orchestrator.cli"], module_level_only=True)
    needed = graph.third_party(start_up, module_level_only=True) & set(NOT_ON_THE_DAEMON_SIDE)
    assert not needed, f"`drainctl` imports {sorted(needed)} before any command runs"


def declared(extra: str | None) -> set[str]:
    """The top-level import names of ``pyproject.toml``'s runtime dependencies (or of one
    extra), as the installed distributions provide them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = (
        project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    )
    wanted = {_distribution(r) for r in requirements} - {"caliban-drain"}
    provided = {
        top: {_canonical(d) for d in distributions}
        for top, distributions in packages_distributions().items()
    }
    missing = wanted - set().union(*provided.values())
    assert not missing, f"declared but not installed here: {sorted(missing)}"
    return {top for top, distributions in provided.items() if wanted & distributions}


def _distribution(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return _canonical(match.group(0))


def _canonical(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def test_runtime_code_imports_only_runtime_dependencies(graph: Graph) -> None:
    runtime = declared(None)
    # The embedded API, the testing kit that drives it and the whole-story demo that runs
    # on it (`drainctl demo` checks for the extra first) are the `dev` extra's code.
    dev_code = ("orchestrator.devcluster", "orchestrator.testing", "orchestrator.demo.story")
    outside = [m for m in graph.modules if not any(is_within(m, d) for d in dev_code)]
    undeclared = graph.third_party(outside) - runtime
    assert not undeclared, (
        f"imported outside orchestrator/devcluster but not a runtime dependency in "
        f"pyproject.toml: {sorted(undeclared)}"
    )


def test_the_embedded_kubernetes_api_imports_only_runtime_and_dev_dependencies(
    graph: Graph,
) -> None:
    allowed = declared(None) | declared("dev")
    inside = [m for m in graph.modules if is_within(m, "orchestrator.devcluster")]
    undeclared = graph.third_party(inside) - allowed
    assert not undeclared, f"orchestrator/devcluster imports undeclared {sorted(undeclared)}"
