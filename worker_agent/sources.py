"""A Workspace's git sources, cloned into the workspace volume by the Sandbox pod's init
container (``drainctl sources``), once: the volume is kept across pauses, resumes and pod
restarts, and so is every checkout on it, with whatever the agents changed in it.

Each source ``name`` is cloned to ``<into>/<name>`` at ``ref``. A checkout already there
(its ``.git`` exists) is kept as it is and never fetched again: refetching would at best
cost a network round trip per resume, and at worst move the agents' ground under them.
A clone goes to a temporary directory beside its destination and is renamed into place
when complete, so a pod killed mid-clone leaves no half checkout that a restart would
then keep; the next start removes the leftover and clones again.

Standard library and the ``git`` binary only: it runs in the daemon's image. The sources
come as JSON in ``CALIBAN_SOURCES`` (``[{"name", "repo", "ref"}]``, what the operator
resolved from the Workspace). A repository URL may hold credentials
(``https://user:token@host/…``), so the log names a source by its ``name`` and its URL
with any user information removed, and never prints git's command line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

SOURCES_ENV = "CALIBAN_SOURCES"
"""The environment variable the init container reads its sources from."""

GIT_TIMEOUT_SECS = 600.0
"""Per git command: a clone of a large repository over a slow link, not a hung remote."""

_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
_TEMP_PREFIX = ".clone-"

log = logging.getLogger(__name__)


class SourceError(Exception):
    """A source cannot be cloned, or the source list is malformed; the message says why
    in one line, naming the source, never a credential."""


@dataclass(frozen=True)
class Source:
    name: str
    repo: str
    ref: str = "main"


def redact(repo: str) -> str:
    """``repo`` without the user information of a URL (``https://***@host/…``)."""
    parts = urlsplit(repo)
    if parts.scheme and "@" in parts.netloc:
        host = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit(parts._replace(netloc=f"***@{host}"))
    return repo


def parse_sources(text: str) -> list[Source]:
    """The JSON list of ``CALIBAN_SOURCES``; a malformed one is a one-line SourceError."""
    try:
        loaded = json.loads(text)
    except ValueError as exc:
        raise SourceError(f"{SOURCES_ENV} is not JSON: {exc}") from None
    if not isinstance(loaded, list):
        raise SourceError(f"{SOURCES_ENV} must be a JSON list of sources")
    sources: list[Source] = []
    for item in loaded:
        if not isinstance(item, dict):
            raise SourceError(f"{SOURCES_ENV}: {item!r} is not an object")
        name, repo, ref = item.get("name"), item.get("repo"), item.get("ref") or "main"
        if not isinstance(name, str) or not _NAME.match(name):
            raise SourceError(f"{SOURCES_ENV}: source name {name!r} is not a DNS label")
        if not isinstance(repo, str) or not repo:
            raise SourceError(f"{SOURCES_ENV}: source {name} has no repo")
        if not isinstance(ref, str):
            raise SourceError(f"{SOURCES_ENV}: source {name} has a ref that is not a string")
        if name in {s.name for s in sources}:
            raise SourceError(f"{SOURCES_ENV}: source {name} is listed twice")
        sources.append(Source(name, repo, ref))
    return sources


def _git(args: Sequence[str], cwd: Path | None = None) -> str:
    """Run git; its stdout, or SourceError with the last line git printed on stderr."""
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_SECS,
            check=False,
        )
    except FileNotFoundError:
        raise SourceError("git is not installed in this image") from None
    except subprocess.TimeoutExpired:
        raise SourceError(f"git {args[0]} took longer than {GIT_TIMEOUT_SECS:g}s") from None
    if done.returncode != 0:
        # git's reasons are its "fatal:"/"error:" lines (a hint may follow them).
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        reasons = [line for line in lines if line.startswith(("fatal:", "error:"))]
        why = "; ".join(reasons or lines[-1:]) or f"git {args[0]} exited {done.returncode}"
        raise SourceError(why)
    return done.stdout.strip()


def clone_source(into: Path, source: Source) -> tuple[str, str]:
    """Clone ``source`` to ``into/<name>`` unless it is there; (``cloned`` or ``kept``,
    the checked-out commit)."""
    dest = into / source.name
    if (dest / ".git").exists():
        return "kept", _git(["rev-parse", "HEAD"], cwd=dest)
    if dest.exists():
        raise SourceError(
            f"source {source.name}: {dest} exists and is not a git checkout; "
            "it is left as it is (move it away to clone the source there)"
        )
    into.mkdir(parents=True, exist_ok=True)
    for leftover in into.glob(f"{_TEMP_PREFIX}{source.name}.*"):
        shutil.rmtree(leftover, ignore_errors=True)  # a clone a killed pod left unfinished
    temp = into / f"{_TEMP_PREFIX}{source.name}.{os.getpid()}"
    try:
        try:
            _git(["clone", "--quiet", "--no-checkout", "--", source.repo, str(temp)])
            _git(["checkout", "--quiet", source.ref], cwd=temp)
        except SourceError as exc:
            raise SourceError(
                f"source {source.name} ({redact(source.repo)} at {source.ref}): {exc}"
            ) from None
        commit = _git(["rev-parse", "HEAD"], cwd=temp)
        temp.rename(dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(temp)
    return "cloned", commit


def clone_all(into: Path, sources: Sequence[Source]) -> list[tuple[Source, str, str]]:
    """Every source cloned or kept, in order; the first failure stops (the pod's init
    container exits non-zero and the pod does not start, as on a cluster)."""
    outcomes = []
    for source in sources:
        outcome, commit = clone_source(into, source)
        log.info(
            "source_%s name=%s repo=%s ref=%s commit=%s",
            outcome,
            source.name,
            redact(source.repo),
            source.ref,
            commit,
        )
        outcomes.append((source, outcome, commit))
    return outcomes


def sources_from_env(env: Mapping[str, str]) -> list[Source]:
    text = env.get(SOURCES_ENV)
    if text is None:
        raise SourceError(f"{SOURCES_ENV} is not set: no sources to clone")
    return parse_sources(text)
