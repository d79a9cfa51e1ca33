"""The images the compose test runs, built here from Debian's packages, as no registry
can be pulled from: a Python base (what ``python:3.11-slim-bookworm`` is to the
published file), the project's image built FROM it by the repository's ``Dockerfile``
with a wheelhouse made on the host, and one image with Debian's Redis and PostgreSQL.

Each is tagged by the hash of what it is made of (package lists; the base's id, the
Dockerfile, the project's source and the pinned dependencies), so a second run finds it
and builds nothing, and a changed source builds a new one. A fresh machine builds all
three: ``mmdebstrap`` makes a root file system from Debian's archive, ``docker import``
makes it an image.

The wheelhouse is made on the host (``pip wheel`` of the project with the versions the
test venv has) and completed for the image's interpreter: a dependency whose marker
holds for Debian's Python but not the host's (``python_full_version < "3.11.3"``) is
found by a dry-run install in the base image and downloaded into the wheelhouse.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[2]
CACHE: Final = Path.home() / ".cache" / "caliban-drain" / "compose-test"
REPOSITORY: Final = "caliban-drain-test"
SUITE: Final = "bookworm"

PYTHON_PACKAGES: Final = ("python3", "python3-venv", "git", "ca-certificates")
"""The base image: Debian's Python 3.11 and its venv module, as the slim image has, and
git, which the image's ``drainctl sources`` (a Workspace's init container) clones with
(the Dockerfile installs it on a base without it)."""
SERVICE_PACKAGES: Final = ("redis-server", "postgresql-15")
"""Redis and PostgreSQL, one image for both services."""

SOURCES: Final = ("orchestrator", "worker_agent", "migrations")
SOURCE_FILES: Final = ("pyproject.toml", "README.md", "Dockerfile", "LICENSE")
EXTRAS: Final = "dev,flower"


class ImageBuildFailed(Exception):
    """An image of the compose test could not be built; the message says which and why."""


def run(*argv: str, timeout: float = 600, cwd: Path | None = None) -> str:
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False
    )
    if result.returncode != 0:
        raise ImageBuildFailed(
            f"{' '.join(argv[:4])}… exited {result.returncode}:\n{result.stderr[-4000:]}"
        )
    return result.stdout


def image_exists(tag: str) -> bool:
    found = subprocess.run(["docker", "image", "inspect", tag], capture_output=True, check=False)
    return found.returncode == 0


def digest(parts: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def debian_image(name: str, packages: tuple[str, ...]) -> str:
    """An image of Debian ``SUITE`` (minbase) with ``packages``; built once per list."""
    tag = f"{REPOSITORY}/{name}:{digest([SUITE.encode(), *(p.encode() for p in packages)])}"
    if image_exists(tag):
        return tag
    with tempfile.TemporaryDirectory(prefix="cd-rootfs-") as scratch:
        rootfs = Path(scratch) / "rootfs.tar"
        run("mmdebstrap", "--variant=minbase", f"--include={','.join(packages)}", SUITE,
            str(rootfs), timeout=900)  # fmt: skip
        run("docker", "import", str(rootfs), tag)
    return tag


def python_base() -> str:
    return debian_image("python-base", PYTHON_PACKAGES)


def services_image() -> str:
    return debian_image("services", SERVICE_PACKAGES)


def _source_files() -> list[Path]:
    files = [ROOT / name for name in SOURCE_FILES if (ROOT / name).is_file()]
    for top in SOURCES:
        files.extend(
            p
            for p in sorted((ROOT / top).rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        )
    return files


def pinned_dependencies() -> bytes:
    """The test venv's versions (the project itself left out): what the image gets."""
    frozen = run(sys.executable, "-m", "pip", "freeze", "--exclude-editable")
    return "\n".join(line for line in frozen.splitlines()
                     if not line.lower().startswith("caliban-drain")).encode()  # fmt: skip


def project_image(base: str) -> str:
    """The repository's Dockerfile built FROM ``base`` with a wheelhouse made here."""
    base_id = run("docker", "image", "inspect", "--format", "{{.Id}}", base).strip()
    constraints = pinned_dependencies()
    sources = _source_files()
    tag = f"{REPOSITORY}/app:" + digest([
        base_id.encode(), constraints,
        *(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() for p in sources),
    ])  # fmt: skip
    if image_exists(tag):
        return tag
    with tempfile.TemporaryDirectory(prefix="cd-image-") as scratch:
        context = Path(scratch)
        wheels = context / "wheels"
        wheelhouse(wheels, constraints, base)
        shutil.copy(ROOT / "Dockerfile", context / "Dockerfile")
        run("docker", "build", "--network", "none", "--build-arg", f"BASE_IMAGE={base}",
            "--build-arg", "WHEELHOUSE=wheels", "--build-arg", f"EXTRAS={EXTRAS}",
            "-t", tag, str(context), timeout=900)  # fmt: skip
    return tag


MISSING: Final = re.compile(r"No matching distribution found for ([^;\s]+)")


def wheelhouse(wheels: Path, constraints: bytes, base: str) -> None:
    """Every wheel the image installs, in ``wheels``: the project's, built from this
    checkout, and its dependencies', cached across runs by their pinned versions."""
    cached = CACHE / f"wheels-{digest([constraints, (ROOT / 'pyproject.toml').read_bytes()])}"
    if not cached.is_dir():
        partial = cached.with_name(cached.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        (partial / "constraints.txt").write_bytes(constraints)
        run(sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(partial),
            "--constraint", str(partial / "constraints.txt"), f"{ROOT}[{EXTRAS}]",
            timeout=900)  # fmt: skip
        _complete_for(base, partial)
        for old in partial.glob("caliban_drain-*.whl"):
            old.unlink()  # the project's wheel is built for each image, below
        partial.rename(cached)
    shutil.copytree(cached, wheels, ignore=shutil.ignore_patterns("constraints.txt"))
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir",
        str(wheels), str(ROOT), timeout=600)  # fmt: skip


def _complete_for(base: str, wheels: Path, rounds: int = 10) -> None:
    """Add what ``base``'s interpreter needs beyond the host's: install dry-run there,
    offline, and download each requirement it reports missing (a marker the host's
    Python does not meet), until it resolves."""
    for _ in range(rounds):
        tried = subprocess.run(
            ["docker", "run", "--rm", "--network", "none", "-v", f"{wheels}:/wheels:ro", base,
             "sh", "-c", "python3 -m venv /tmp/v && /tmp/v/bin/pip install --dry-run "
             f"--no-index --find-links /wheels 'caliban-drain[{EXTRAS}]' 2>&1"],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        missing = MISSING.findall(tried.stdout)
        if not missing:
            return
        run(sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
            "--only-binary=:all:", "--dest", str(wheels), *missing)  # fmt: skip
    raise ImageBuildFailed(f"the wheelhouse in {wheels} still misses requirements")


def drop_other_builds(keep: str) -> None:
    """Remove the project's images of other sources than ``keep`` and the dangling
    layers of their builds: each run of a changed tree would otherwise leave one."""
    listed = run("docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}",
                 f"{REPOSITORY}/app")  # fmt: skip
    stale = [tag for tag in listed.split() if tag != keep]
    if stale:
        run("docker", "image", "rm", *stale)
    run("docker", "image", "prune", "--force")


def build_all() -> tuple[str, str]:
    """The project's image and the services' image, each built if missing; the
    project's images of other sources are dropped. Answers (app, services)."""
    app = project_image(python_base())
    services = services_image()
    drop_other_builds(app)
    return app, services


def main() -> int:
    """``python -m tests.compose.images``: build what the compose test runs, ahead of it
    (``make test`` does so while the suite runs); one line on failure, exit 1."""
    try:
        app, services = build_all()
    except (ImageBuildFailed, OSError, subprocess.TimeoutExpired) as exc:
        print(f"compose images: {exc}", file=sys.stderr)
        return 1
    print(f"compose images: {app} {services}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
