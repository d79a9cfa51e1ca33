"""``drainctl sources``, the Sandbox pod's init container (``worker_agent.sources``): a
Workspace's git sources cloned into the workspace volume once, from local repositories
made here with the real ``git``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from worker_agent.sources import (
    SOURCES_ENV,
    Source,
    SourceError,
    clone_all,
    clone_source,
    parse_sources,
    redact,
)

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(*args: str, cwd: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost"}  # fmt: skip
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          check=True)  # fmt: skip
    return done.stdout.strip()


def make_repo(path: Path, branch: str = "main") -> str:
    """A repository with one commit on ``branch`` and a tag ``v1``; its commit."""
    path.mkdir(parents=True)
    git("init", "--quiet", "--initial-branch", branch, cwd=path)
    (path / "README.md").write_text("hello\n")
    git("add", "README.md", cwd=path)
    git("commit", "--quiet", "-m", "first", cwd=path)
    git("tag", "v1", cwd=path)
    return git("rev-parse", "HEAD", cwd=path)


def test_a_source_is_cloned_once_and_kept_even_when_its_remote_is_gone(tmp_path: Path) -> None:
    commit = make_repo(tmp_path / "origin")
    into = tmp_path / "volume" / "sources"
    source = Source("app", str(tmp_path / "origin"), "main")
    assert clone_source(into, source) == ("cloned", commit)
    assert (into / "app" / "README.md").read_text() == "hello\n"
    (into / "app" / "work.txt").write_text("an agent's change\n")
    shutil.rmtree(tmp_path / "origin")  # a refetch would now fail
    assert clone_source(into, source) == ("kept", commit)
    assert (into / "app" / "work.txt").read_text() == "an agent's change\n"


def test_a_ref_may_be_a_branch_a_tag_or_a_commit(tmp_path: Path) -> None:
    first = make_repo(tmp_path / "origin", branch="trunk")
    origin = tmp_path / "origin"
    (origin / "b.txt").write_text("b\n")
    git("add", "b.txt", cwd=origin)
    git("commit", "--quiet", "-m", "second", cwd=origin)
    second = git("rev-parse", "HEAD", cwd=origin)
    outcomes = clone_all(tmp_path / "into", [
        Source("tip", str(origin), "trunk"), Source("tag", str(origin), "v1"),
        Source("pinned", str(origin), first),
    ])  # fmt: skip
    assert [(s.name, o, c) for s, o, c in outcomes] == [
        ("tip", "cloned", second),
        ("tag", "cloned", first),
        ("pinned", "cloned", first),
    ]


def test_a_clone_that_fails_says_why_in_one_line_without_the_credential(tmp_path: Path) -> None:
    """Tried: an unreachable remote whose URL holds a token, and an unknown ref."""
    into = tmp_path / "into"
    repo = "http://user:s3cr3t-token@127.0.0.1:1/nothing.git"
    with pytest.raises(SourceError) as raised:
        clone_source(into, Source("app", repo, "main"))
    message = str(raised.value)
    assert message.startswith("source app (http://***@127.0.0.1:1/nothing.git at main): ")
    assert "s3cr3t-token" not in message and "\n" not in message
    assert not (into / "app").exists() and list(into.iterdir()) == []  # no half clone kept
    make_repo(tmp_path / "origin")
    with pytest.raises(SourceError) as raised:
        clone_source(into, Source("app", str(tmp_path / "origin"), "no-such-ref"))
    assert "no-such-ref" in str(raised.value)
    assert list(into.iterdir()) == []


def test_a_clone_a_killed_pod_left_is_removed_and_done_again(tmp_path: Path) -> None:
    commit = make_repo(tmp_path / "origin")
    into = tmp_path / "into"
    leftover = into / ".clone-app.4242"
    leftover.mkdir(parents=True)
    (leftover / "partial").write_text("x")
    assert clone_source(into, Source("app", str(tmp_path / "origin"))) == ("cloned", commit)
    assert not leftover.exists()


def test_a_directory_in_the_way_is_left_as_it_is(tmp_path: Path) -> None:
    """Tried: the destination exists and is not a checkout (someone's files)."""
    make_repo(tmp_path / "origin")
    (tmp_path / "into" / "app").mkdir(parents=True)
    (tmp_path / "into" / "app" / "mine.txt").write_text("keep me")
    with pytest.raises(SourceError, match="exists and is not a git checkout"):
        clone_source(tmp_path / "into", Source("app", str(tmp_path / "origin")))
    assert (tmp_path / "into" / "app" / "mine.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("not json", "is not JSON"),
        ('{"name": "a"}', "must be a JSON list"),
        ('[{"name": "../up", "repo": "r"}]', "is not a DNS label"),
        ('[{"name": "a"}]', "source a has no repo"),
        ('[{"name": "a", "repo": "r"}, {"name": "a", "repo": "r"}]', "listed twice"),
    ],
)
def test_a_malformed_source_list_is_refused(text: str, says: str) -> None:
    with pytest.raises(SourceError, match=says):
        parse_sources(text)


def test_redact_hides_only_user_information() -> None:
    assert redact("https://x:y@127.0.0.1/r.git") == "https://***@127.0.0.1/r.git"
    assert redact("git@127.0.0.1:caliban") == "git@127.0.0.1:caliban"
    assert redact("/srv/r.git") == "/srv/r.git"


def run_drainctl(into: Path, sources: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != SOURCES_ENV}
    if sources is not None:
        env[SOURCES_ENV] = sources
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "sources", "--into", str(into)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_drainctl_sources_clones_then_keeps_and_logs_each_source(tmp_path: Path) -> None:
    commit = make_repo(tmp_path / "origin")
    sources = json.dumps([{"name": "app", "repo": str(tmp_path / "origin"), "ref": "main"}])
    first = run_drainctl(tmp_path / "into", sources)
    assert first.returncode == 0, first.stderr
    assert f"source_cloned name=app repo={tmp_path / 'origin'} ref=main commit={commit}" in (
        first.stderr
    )
    again = run_drainctl(tmp_path / "into", sources)
    assert again.returncode == 0, again.stderr
    assert "source_kept name=app" in again.stderr and "source_cloned" not in again.stderr


@pytest.mark.parametrize(
    ("tried", "sources", "says"),
    [
        ("no CALIBAN_SOURCES", None, "CALIBAN_SOURCES is not set"),
        ("CALIBAN_SOURCES not JSON", "[oops", "CALIBAN_SOURCES is not JSON"),
        ("a repository that is not there", '[{"name": "a", "repo": "/nonexistent/r.git"}]',
         "source a (/nonexistent/r.git at main): "),
    ],
)  # fmt: skip
def test_drainctl_sources_refuses_bad_input_in_one_line_and_exits_1(
    tmp_path: Path, tried: str, sources: str | None, says: str
) -> None:
    done = run_drainctl(tmp_path / "into", sources)
    assert done.returncode == 1, tried
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and says in errors[0], (tried, done.stderr)
    assert "Traceback" not in done.stderr, tried
