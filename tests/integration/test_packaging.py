"""What the distribution promises, tried on real processes.

- The CRDs are package data: the wheel carries them (and the migrations), and
  ``deploy/crds/`` holds byte-identical copies for ``kubectl apply -f`` and kustomize
  (kustomize refuses a symlink that leaves its root, so copies, kept equal here).
- A wheel built from this tree and installed with ``[dev]`` into a fresh venv runs
  ``drainctl dev up`` from a directory that is not the checkout, and ``kubectl`` sees the
  CRDs it served; installed without extras it imports everything the operator, the
  orchestrator worker and the daemon run, and ``drainctl dev …`` and ``drainctl flower``
  name the extra to install in one line (slow: these build venvs).
- The daemon side runs with kopf, Flower, kmock and SQLAlchemy unimportable: a
  ``sitecustomize`` on ``PYTHONPATH`` makes every process of the test (``drainctl
  daemon``, its consumer child ``python -m worker_agent.consumer``, and the agent
  ``python -m worker_agent.worker``) refuse them, and the daemon still answers
  ``status``, runs an agent and drains it through its Celery consumer.

The venv's dependencies come from a wheelhouse downloaded once per ``pyproject.toml``
(cached under /tmp by its hash), so a rerun installs offline in seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from orchestrator.cli.errors import ExitCode
from tests.integration.test_demo import run_json_demo, summary_problems
from tests.pipeline_support import redis_db_url
from tests.support import DaemonProcess, wait_until

REPO = Path(__file__).resolve().parents[2]
PACKAGED_CRDS = {
    "calibantask.yaml": "orchestrator/operator/crds/calibantask.yaml",
    "workspace.yaml": "orchestrator/operator/crds/workspace.yaml",
}
"""``deploy/crds/<file>`` → the packaged CRD it copies."""
SNAPSHOT_PACKAGE_DATA = tuple(
    f"orchestrator/devcluster/crds/snapshots/{name}"
    for name in (
        "snapshot.storage.k8s.io_volumesnapshots.yaml",
        "snapshot.storage.k8s.io_volumesnapshotclasses.yaml",
        "snapshot.storage.k8s.io_volumesnapshotcontents.yaml",
        "README.md",
        "LICENSE",
    )
)
"""The external-snapshotter's CRDs the dev stack serves, with where they come from and
their licence: package data, but never in ``deploy/crds/`` (a cluster's CSI distribution
installs them)."""

SANDBOX_PACKAGE_DATA = tuple(
    f"orchestrator/devcluster/crds/agent-sandbox/{name}"
    for name in ("agents.x-k8s.io_sandboxes.yaml", "README.md", "LICENSE")
)
"""agent-sandbox's Sandbox CRD the dev stack serves, with where it comes from and its
licence: package data, but not in ``deploy/crds/`` (a cluster installs agent-sandbox's)."""

BLOCKED = ("kopf", "flower", "kmock", "sqlalchemy")

BLOCKER = '''
"""Test bootstrap: these top-level modules are not installed, as in a Sandbox pod."""
import os
import sys

BLOCKED = {blocked!r}


class _NotInstalled:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked: not installed in a daemon pod", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled)
with open(os.path.join({marks!r}, f"blocker-active-{{os.getpid()}}"), "w"):
    pass
'''


# ----------------------------------------------------------------------- package data


@pytest.mark.parametrize("deployed", sorted(PACKAGED_CRDS))
def test_deploy_crds_are_byte_identical_copies_of_the_packaged_ones(deployed: str) -> None:
    packaged = REPO / PACKAGED_CRDS[deployed]
    copy = REPO / "deploy" / "crds" / deployed
    assert copy.read_bytes() == packaged.read_bytes(), (
        f"deploy/crds/{deployed} differs from {PACKAGED_CRDS[deployed]} (the source): "
        f"cp {PACKAGED_CRDS[deployed]} deploy/crds/{deployed}"
    )


def test_deploy_crds_holds_only_the_packaged_crds() -> None:
    """And the kustomization that hands the CalibanTask CRD to ``deploy/base``."""
    listed = sorted(p.name for p in (REPO / "deploy" / "crds").iterdir())
    assert listed == sorted([*PACKAGED_CRDS, "kustomization.yaml"])


def _source_copy(destination: Path) -> Path:
    """This tree without build leftovers (a stale ``build/`` would leak into the wheel)."""
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
        ".dev-stack", ".demo", "caliban-store", "control",
    )  # fmt: skip
    shutil.copytree(REPO, destination, ignore=ignore, symlinks=True)
    return destination


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this tree, built in a temp dir."""
    root = tmp_path_factory.mktemp("wheel")
    source = _source_copy(root / "src")
    out = root / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out),
         str(source)],
        check=True, timeout=300, env=_clean_env(),
    )  # fmt: skip
    (built,) = out.glob("caliban_drain-*.whl")
    return built


def test_the_wheel_carries_the_crds_and_the_migrations(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for packaged in (*PACKAGED_CRDS.values(), *SNAPSHOT_PACKAGE_DATA, *SANDBOX_PACKAGE_DATA):
            assert packaged in names
            assert archive.read(packaged) == (REPO / packaged).read_bytes()
    assert {"migrations/env.py", "migrations/script.py.mako"} <= names
    assert {"orchestrator/py.typed", "worker_agent/py.typed"} <= names


def test_the_wheel_carries_the_apache_licence_and_says_so(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        dist_info = next(n.split("/")[0] for n in archive.namelist() if n.endswith("/METADATA"))
        licence = archive.read(f"{dist_info}/licenses/LICENSE")
        metadata = archive.read(f"{dist_info}/METADATA").decode().splitlines()
    assert licence == (REPO / "LICENSE").read_bytes()
    assert {"License-Expression: Apache-2.0", "License-File: LICENSE"} <= set(metadata)


def _kubectl_crds(kubeconfig: Path) -> str | None:
    """``kubectl get crd -o name`` against ``kubeconfig``, or None while it cannot answer."""
    if not kubeconfig.exists():
        return None
    listed = subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), "get", "crd", "-o", "name"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    return listed.stdout if listed.returncode == 0 else None


def _stop(proc: subprocess.Popen[bytes], within: float) -> int:
    """SIGTERM, then SIGKILL (and fail) if ``proc`` is still running after ``within``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def _assert_serves_the_crds(
    argv: list[str],
    kubeconfig: Path,
    *,
    cwd: Path,
    env: dict[str, str] | None,
    within: float = 60,
    expected: tuple[str, ...],
) -> None:
    """Run ``argv`` until ``kubectl get crd`` through ``kubeconfig`` lists the packaged
    CRDs, then SIGTERM it; it must exit 0."""
    log_path = cwd / "server.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:

        def served() -> str | None:
            if server.poll() is not None:
                raise AssertionError(f"exited {server.returncode}: {log_path.read_text()}")
            return _kubectl_crds(kubeconfig)

        listed = wait_until(served, within, f"kubectl get crd against {argv[1:4]}")
        assert sorted(listed.split()) == sorted(expected)
    finally:
        code = _stop(server, 90)
    assert code == 0, log_path.read_text()


SERVED_CRDS = (
    "customresourcedefinition.apiextensions.k8s.io/calibantasks.caliban.caliban-ai.dev",
    "customresourcedefinition.apiextensions.k8s.io/workspaces.caliban.caliban-ai.dev",
    "customresourcedefinition.apiextensions.k8s.io/sandboxes.agents.x-k8s.io",
    "customresourcedefinition.apiextensions.k8s.io/volumesnapshots.snapshot.storage.k8s.io",
    "customresourcedefinition.apiextensions.k8s.io/volumesnapshotclasses.snapshot.storage.k8s.io",
    "customresourcedefinition.apiextensions.k8s.io/volumesnapshotcontents.snapshot.storage.k8s.io",
)
"""What ``dev cluster`` serves by default: the packaged CRDs and the snapshot ones."""
STACK_CRDS = (
    *SERVED_CRDS,
    "customresourcedefinition.apiextensions.k8s.io/clusterkopfpeerings.kopf.dev",
    "customresourcedefinition.apiextensions.k8s.io/kopfpeerings.kopf.dev",
)
"""What ``dev up`` serves: those and kopf's peering CRDs, for operators run with
``--peering``."""


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_drainctl_dev_cluster_serves_the_packaged_crds_by_default(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig.yaml"
    argv = [sys.executable, "-m", "orchestrator.cli", "dev", "cluster", "--kubeconfig"]
    _assert_serves_the_crds(
        [*argv, str(kubeconfig)], kubeconfig, cwd=tmp_path, env=None, expected=SERVED_CRDS
    )


# ---------------------------------------------------------- the repository is self-contained

DOCS = ("README.md", "docs/*.md", "bench/RESULTS.md")
TOP_LEVEL = ("orchestrator", "worker_agent", "migrations", "deploy", "docs", "tests", "bench")
OUTSIDE = ("DESIGN" + ".md", "ADR" + " 0057", "ADR" + "-0057", "../" + "shared")
"""Names of files that live outside the repository (spelled in pieces, so this file does
not match itself)."""


def _docs() -> list[Path]:
    return sorted({p for pattern in DOCS for p in REPO.glob(pattern)})


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_and_link_in_a_doc_exists_in_the_repository(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    named = [
        t
        for t in re.findall(r"`([^`\s]+)`", text)
        if t.startswith(tuple(f"{top}/" for top in TOP_LEVEL)) and not re.search(r"[<*…{]", t)
    ]
    missing = [t for t in named if not (REPO / t.rstrip("/")).exists()]
    links = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)]
    missing += [t for t in links if t and ":" not in t and not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(REPO)} names what the repository does not hold"


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_test_a_doc_names_exists(doc: Path) -> None:
    """``file.py::test_name`` names a test function in a file of that name under
    ``tests/`` (``tests/unit/file.py::test_name``: in that very file); a bare
    ``::test_name`` continues the file named just before it."""
    files: dict[str, list[Path]] = {}
    for path in (REPO / "tests").rglob("test_*.py"):
        files.setdefault(path.name, []).append(path)
    missing, last = [], ""
    for cited in re.findall(r"`([\w./]*::\w+)`", doc.read_text(encoding="utf-8")):
        name, _, test = cited.partition("::")
        last = name or last
        paths = [REPO / last] if "/" in last else files.get(Path(last).name, [])
        defined = rf"^\s*(?:async )?def {test}\("
        if not any(p.is_file() and re.search(defined, p.read_text(), re.M) for p in paths):
            missing.append(cited)
    assert not missing, f"{doc.relative_to(REPO)} names tests that do not exist: {missing}"


def test_nothing_cites_a_file_outside_the_repository() -> None:
    tracked = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split()  # fmt: skip
    citing = []
    for name in tracked:
        path = REPO / name
        if not path.is_file() or path.suffix in {".whl", ".png", ".db"}:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        citing += [f"{name}: {o}" for o in OUTSIDE if o in text]
    assert not citing, "point these at docs/architecture.md or the docs in docs/:\n" + "\n".join(
        citing
    )


# --------------------------------------------------------------- a wheel in a fresh venv


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without what points at the checkout or at another test's servers."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "VIRTUAL_ENV", "KUBECONFIG"} and not k.startswith("DRAIN_")
    }
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def _wheelhouse(wheel: Path) -> Path:
    """The wheels of ``caliban-drain[dev]``'s dependencies, downloaded once per
    ``pyproject.toml``; written to a temp dir and renamed, so a half-done download is
    never taken for a whole one."""
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()[:16]
    house = Path(tempfile.gettempdir()) / f"caliban-drain-wheelhouse-{digest}"
    if house.is_dir():
        return house
    partial = Path(tempfile.mkdtemp(prefix=f"{house.name}-partial-", dir=house.parent))
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "-d", str(partial),
         f"{wheel}[dev]"],
        check=True, timeout=600, env=_clean_env(),
    )  # fmt: skip
    for own in partial.glob("caliban_drain-*.whl"):
        own.unlink()  # the tree's own wheel is rebuilt every run
    with contextlib.suppress(OSError):  # another run finished first: keep its copy
        partial.rename(house)
    shutil.rmtree(partial, ignore_errors=True)
    return house


def _make_venv(root: Path, wheel: Path, extras: str) -> Path:
    """A fresh venv at ``root`` with ``wheel[extras]`` installed offline."""
    house = _wheelhouse(wheel)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=300)
    subprocess.run(
        [str(root / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-index",
         "--find-links", str(house), f"{wheel}{extras}"],
        check=True, timeout=600, env=_clean_env(),
    )  # fmt: skip
    return root


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel and its ``[dev]`` extra."""
    return _make_venv(tmp_path_factory.mktemp("venv") / "venv", wheel, "[dev]")


@pytest.fixture(scope="module")
def bare_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel and its runtime dependencies only."""
    return _make_venv(tmp_path_factory.mktemp("bare") / "venv", wheel, "")


RUNTIME_ENTRY_MODULES = (
    "orchestrator.cli",
    "orchestrator.operator.main",
    "orchestrator.pipeline.tasks",
    "orchestrator.pipeline.start",
    "orchestrator.ledger",
    "worker_agent.server",
    "worker_agent.worker",
    "worker_agent.consumer",
)
"""What the operator, the orchestrator worker and the daemon pod run."""


@pytest.mark.slow
def test_the_runtime_dependencies_alone_run_the_operator_the_worker_and_the_daemon(
    bare_venv: Path, tmp_path: Path
) -> None:
    imported = subprocess.run(
        [str(bare_venv / "bin" / "python"), "-c",
         f"import {', '.join(RUNTIME_ENTRY_MODULES)}"],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "extra"),
    [
        (["dev", "up", "--kubeconfig", "k.yaml"], "dev"),
        (["dev", "cluster", "--kubeconfig", "k.yaml"], "dev"),
        (["flower"], "flower"),
    ],
    ids=["dev-up", "dev-cluster", "flower"],
)
def test_a_command_whose_extra_is_missing_says_which_to_install_in_one_line(
    bare_venv: Path, tmp_path: Path, command: list[str], extra: str
) -> None:
    ran = subprocess.run(
        [str(bare_venv / "bin" / "drainctl"), *command],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    # A missing extra is configuration, not a failed operation (docs/cli.md).
    assert ran.returncode == ExitCode.USAGE, ran.stderr
    assert "Traceback" not in ran.stderr
    (line,) = ran.stderr.strip().splitlines()
    assert line.endswith(f"pip install 'caliban-drain[{extra}]'"), line


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_a_wheel_installed_with_dev_runs_drainctl_dev_up_outside_the_checkout(
    venv: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = _clean_env()
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import orchestrator; print(orchestrator.__file__)"],
        cwd=elsewhere, env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout

    kubeconfig = elsewhere / "kubeconfig.yaml"
    argv = [str(venv / "bin" / "drainctl"), "dev", "up", "--kubeconfig", str(kubeconfig),
            "--state-dir", str(elsewhere / "state")]  # fmt: skip
    _assert_serves_the_crds(
        argv, kubeconfig, cwd=elsewhere, env=env, within=120, expected=STACK_CRDS
    )


@pytest.mark.slow
def test_drainctl_demo_json_from_a_fresh_venv_tells_the_whole_story(
    venv: Path, tmp_path: Path
) -> None:
    """What a newcomer's first command does, from the wheel alone: every step happened,
    every agent's turns after each resume are at least those before, no lost turn."""
    summary = run_json_demo([str(venv / "bin" / "drainctl")], tmp_path, _clean_env())
    assert summary_problems(summary) == []


# ------------------------------------------------------------- the daemon without them


@pytest.fixture
def blocked_env(tmp_short: Path) -> tuple[dict[str, str], Path]:
    """An environment whose Python processes cannot import :data:`BLOCKED`, and the dir
    where each such process leaves a mark that the blocker was active in it."""
    boot = tmp_short / "boot"
    marks = tmp_short / "marks"
    boot.mkdir()
    marks.mkdir()
    (boot / "sitecustomize.py").write_text(BLOCKER.format(blocked=BLOCKED, marks=str(marks)))
    path = os.pathsep.join(p for p in (str(boot), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}, marks


def test_the_blocker_makes_kopf_flower_kmock_and_sqlalchemy_unimportable(
    blocked_env: tuple[dict[str, str], Path],
) -> None:
    env, _ = blocked_env
    for name in BLOCKED:
        tried = subprocess.run(
            [sys.executable, "-c", f"import {name}"],
            env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert tried.returncode == 1
        assert f"{name} is blocked" in tried.stderr


def test_the_daemon_serves_runs_and_drains_agents_without_kopf_flower_kmock_or_sqlalchemy(
    tmp_short: Path, blocked_env: tuple[dict[str, str], Path]
) -> None:
    from orchestrator.pipeline.app import DAEMON_DRAIN, make_app
    from orchestrator.settings import Settings

    env, marks = blocked_env
    broker = redis_db_url(db=13)
    queue = "caliband.packaging.blocked"
    env = {**env, "DRAIN_BROKER_URL": broker, "DRAIN_RESULT_BACKEND": broker}
    daemon = DaemonProcess(tmp_short, "--queue", queue, env=env).start()
    try:
        status = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "agents", "--socket", str(daemon.socket),
             "--json", "status"],
            env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        assert daemon.proc is not None
        assert json.loads(status.stdout)["pid"] == daemon.proc.pid

        (agent,) = daemon.spawn_working(1, "turns=1000,turn_ms=20", min_turns=2)
        workers = _child_pids(daemon, "worker")
        assert len(workers) == 1, workers
        consumer = wait_until(lambda: _child_pids(daemon, "consumer"), 30, "the consumer child")

        app = make_app(Settings(broker_url=broker, result_backend=broker))
        drained = app.send_task(
            DAEMON_DRAIN, kwargs={"op_id": "op-packaging", "grace_secs": 10}, queue=queue
        ).get(timeout=120)
        assert drained["error"] is None
        assert [(ref["id"], ref["clean"]) for ref in drained["refs"]] == [(agent, True)]
        assert daemon.records()[agent].status.value == "drained"
        # Each of the three programs ran with the blocker installed.
        assert {daemon.proc.pid, *consumer, *workers} <= _marked(marks)
    finally:
        daemon.stop()
    assert daemon.wait() == 0, daemon.log.read_text()
    assert "Traceback" not in daemon.log.read_text(), daemon.log.read_text()


def _marked(marks: Path) -> set[int]:
    """The pids of the processes in which the blocker was installed."""
    return {int(p.name.rsplit("-", 1)[1]) for p in marks.glob("blocker-active-*")}


def _child_pids(daemon: DaemonProcess, module: str) -> set[int]:
    """The daemon's children running ``python -m worker_agent.<module>``."""
    import psutil

    assert daemon.proc is not None
    found: set[int] = set()
    for child in psutil.Process(daemon.proc.pid).children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if f"worker_agent.{module}" in child.cmdline():
                found.add(child.pid)
    return found
