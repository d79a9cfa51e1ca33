"""``drainctl``'s one convention, tried command by command: ``--json`` after every
command that prints (and before it, on the groups that always took it), ``--log-level``
as the one spelling, help on every option, and commands that load only what they need.
Real subprocesses against a real daemon, Redis, SQLite ledger, orchestrator worker and
the embedded Kubernetes API; the help walk reads the real click command tree."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import click
import pytest
import yaml

from orchestrator.cli import ExitCode, main
from orchestrator.ledger import CheckpointReason, Ledger, OperationKind, OperationState
from tests.integration.cli_support import drainctl
from tests.pipeline_support import Stack, fresh_sqlite, redis_db_url
from tests.support import DaemonProcess, wait_until
from worker_agent.proto import ResumeRef

SHA = "ab" * 32


def ok_json(result: subprocess.CompletedProcess[str]) -> object:
    assert result.returncode == ExitCode.OK, result.stderr
    return json.loads(result.stdout)


# ------------------------------------------------------------------- the ledger


@pytest.fixture
def ledger_with_checkpoints(tmp_path: Path) -> tuple[str, str, str]:
    """A migrated SQLite ledger holding one drained and one forced checkpoint of ns/t."""
    url = fresh_sqlite(tmp_path)
    ledger = Ledger.from_url(url)
    refs = []
    drained_agent = ResumeRef(
        id="agent-1", session_dir="agents/agent-1", turns=3, session_sha256=SHA, clean=True,
        exit=0,
    )  # fmt: skip
    for key, forced, agents in [("drained", False, [drained_agent]), ("forced", True, [])]:
        op = ledger.begin_operation(
            OperationKind.DRAIN, task_uid="ns/t", namespace="ns", name="t", idempotency_key=key
        )
        ledger.transition(op.id, OperationState.DRAINING)
        checkpoint = ledger.record_checkpoint(
            op.id, agents, reason=CheckpointReason.MANUAL, forced=forced
        )
        refs.append(checkpoint.ref)
    ledger.dispose()
    return url, refs[0], refs[1]


def test_ledger_ls_takes_json_after_the_command_and_after_the_group(
    ledger_with_checkpoints: tuple[str, str, str],
) -> None:
    """Tried: ledger ls --json and ledger --json ls; both list the same two checkpoints."""
    url, drained, forced = ledger_with_checkpoints
    env = {"DRAIN_DATABASE_URL": url}
    after = ok_json(drainctl("ledger", "ls", "--json", env=env))
    before = ok_json(drainctl("ledger", "--json", "ls", env=env))
    assert after == before
    assert isinstance(after, list)
    assert {c["ref"]: c["forced"] for c in after} == {drained: False, forced: True}


def test_ledger_ls_shows_forced_and_verified_as_separate_columns(
    ledger_with_checkpoints: tuple[str, str, str],
) -> None:
    """Tried: ledger ls (human); the FORCED and VERIFIED columns each say yes or no."""
    url, drained, forced = ledger_with_checkpoints
    result = drainctl("ledger", "ls", env={"DRAIN_DATABASE_URL": url})
    assert result.returncode == ExitCode.OK, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == [
        "REF", "TASK", "REASON", "AGENTS", "FORCED", "VERIFIED", "WORKSPACE", "SNAPSHOT",
        "CREATED",
    ]  # fmt: skip
    cells = {row.split()[0]: row.split() for row in rows}
    assert cells[drained][1:8] == ["ns/t", "manual", "1", "no", "yes", "kept", "-"]
    assert cells[forced][1:5] == ["ns/t", "manual", "0", "yes"]
    ledger = Ledger.from_url(url)
    try:
        forced_view = ledger.get_checkpoint(forced)
        assert forced_view is not None
        # The column shows the ledger's flag as it is (a forced checkpoint is never
        # verified once the ledger's fix lands; the CLI only shows it).
        assert cells[forced][5] == ("yes" if forced_view.verified else "no")
    finally:
        ledger.dispose()


def test_ledger_ls_and_show_say_which_checkpoints_workspace_is_gone(
    ledger_with_checkpoints: tuple[str, str, str],
) -> None:
    """Tried: a checkpoint the operator marked unavailable (its PVC was deleted)."""
    url, drained, forced = ledger_with_checkpoints
    ledger = Ledger.from_url(url)
    try:
        marked = ledger.mark_checkpoint_unavailable(forced, "PVC ns/ws-1 no longer exists")
        assert marked is not None and not marked.available
        again = ledger.mark_checkpoint_unavailable(forced, "a later reason")
        assert again is not None and again.unavailable == "PVC ns/ws-1 no longer exists"
        assert ledger.mark_checkpoint_unavailable("ckpt-nope", "gone") is None
    finally:
        ledger.dispose()
    env = {"DRAIN_DATABASE_URL": url}
    listed = drainctl("ledger", "ls", env=env)
    cells = {row.split()[0]: row.split() for row in listed.stdout.splitlines()[1:]}
    assert (cells[drained][6], cells[forced][6]) == ("kept", "GONE")
    shown = drainctl("ledger", "show", forced, env=env)
    assert "unavailable: PVC ns/ws-1 no longer exists" in shown.stdout
    as_json = ok_json(drainctl("ledger", "ls", "--json", env=env))
    assert isinstance(as_json, list)
    assert {c["ref"]: c["unavailable"] for c in as_json} == {
        drained: None, forced: "PVC ns/ws-1 no longer exists"
    }  # fmt: skip


def test_ledger_ls_pages_with_after_and_refuses_an_unknown_ref_in_one_line(
    ledger_with_checkpoints: tuple[str, str, str],
) -> None:
    """Tried: ledger ls --limit 1 -q, then --after the ref it printed, then --after a ref
    the ledger does not hold."""
    url, drained, forced = ledger_with_checkpoints
    env = {"DRAIN_DATABASE_URL": url}
    first = drainctl("ledger", "ls", "--limit", "1", "-q", env=env)
    assert first.stdout == f"{forced}\n"  # the newer of the two
    second = drainctl("ledger", "ls", "--limit", "1", "-q", "--after", forced, env=env)
    assert second.stdout == f"{drained}\n"
    unknown = drainctl("ledger", "ls", "--after", "ckpt-nope", env=env)
    assert unknown.returncode == ExitCode.FAILED and "Traceback" not in unknown.stderr
    assert unknown.stderr.strip().splitlines() == [
        "Error: --after: no checkpoint 'ckpt-nope' in the ledger; list them: drainctl ledger ls"
    ]


def test_ledger_show_takes_json_after_the_ref_and_before_the_command(
    ledger_with_checkpoints: tuple[str, str, str],
) -> None:
    """Tried: ledger show REF --json and ledger --json show REF; an unknown ref exits 1."""
    url, drained, _ = ledger_with_checkpoints
    env = {"DRAIN_DATABASE_URL": url}
    after = ok_json(drainctl("ledger", "show", drained, "--json", env=env))
    assert after == ok_json(drainctl("ledger", "--json", "show", drained, env=env))
    assert isinstance(after, dict)
    assert after["ref"] == drained and after["agents"][0]["agent_id"] == "agent-1"
    unknown = drainctl("ledger", "show", "ckpt-nope", "--json", env=env)
    assert unknown.returncode == ExitCode.FAILED and "no checkpoint 'ckpt-nope'" in unknown.stderr


def test_db_upgrade_takes_json(tmp_path: Path) -> None:
    """Tried: db upgrade --json on a new SQLite file (and again: a no-op at head)."""
    env = {"DRAIN_DATABASE_URL": f"sqlite:///{tmp_path}/l.db"}
    first = ok_json(drainctl("db", "upgrade", "--json", env=env))
    again = ok_json(drainctl("db", "upgrade", "--json", env=env))
    assert isinstance(first, dict) and first == again
    assert first["database"] == f"sqlite:///{tmp_path}/l.db" and first["revision"]


# ------------------------------------------------------------------ the pipeline


@pytest.fixture
def stack(tmp_short: Path) -> Iterator[Stack]:
    s = Stack(tmp_short, redis_db_url(), fresh_sqlite(tmp_short))
    try:
        yield s
    finally:
        s.close()


def test_drain_and_resume_take_json_after_wait(stack: Stack) -> None:
    """Tried: drain NS/NAME --wait --json, then resume NS/NAME --checkpoint REF --wait
    --json, with a real worker and daemon; both exit 0 and print the operation row."""
    stack.start_worker()
    daemon = stack.start_daemon("team-j", "task-1")
    daemon.spawn_working(2, "turns=100000,turn_ms=50", 1)
    drained = ok_json(stack_drainctl(stack, "drain", "team-j/task-1", "--wait", "--json"))
    assert isinstance(drained, dict)
    assert drained["state"] == "recorded" and drained["checkpoint_ref"].startswith("ckpt-")
    resume = ("resume", "team-j/task-1", "--checkpoint", drained["checkpoint_ref"], "--wait")
    resumed = ok_json(stack_drainctl(stack, *resume, "--json"))
    assert isinstance(resumed, dict) and resumed["state"] == "resumed"


def stack_drainctl(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return stack.drainctl(*args, "--timeout", "90")


def test_worker_takes_log_level_and_still_the_deprecated_loglevel(tmp_path: Path) -> None:
    """Tried: worker --help (shows --log-level, hides --loglevel), then worker --loglevel
    debug and worker --log-level debug with a broker URL that is refused before start."""
    shown = drainctl("worker", "--help")
    assert "--log-level" in shown.stdout and "--loglevel" not in shown.stdout
    env = {"DRAIN_BROKER_URL": "nope://x", "DRAIN_DATABASE_URL": f"sqlite:///{tmp_path}/l.db"}
    old = drainctl("worker", "--loglevel", "debug", env=env)
    assert old.returncode == ExitCode.USAGE  # accepted, then refused for the broker URL
    assert "--loglevel is deprecated; use --log-level" in old.stderr
    new = drainctl("worker", "--log-level", "debug", env=env)
    assert new.returncode == ExitCode.USAGE and "deprecated" not in new.stderr


# --------------------------------------------------------------- daemon's agents


def test_agents_take_json_after_the_subcommand_and_after_the_group(
    daemon: DaemonProcess,
) -> None:
    """Tried: agents --socket S <cmd> --json for spawn, ls, status, kill, rm, drain,
    resume, and agents --socket S --json ls; each prints the daemon's reply as JSON."""
    sock = str(daemon.socket)
    spawn = ("agents", "--socket", sock, "spawn", "--model", "turns=100000,turn_ms=20")
    spawned = ok_json(drainctl(*spawn, "--json"))
    assert isinstance(spawned, dict)
    agent_id = spawned["id"]
    after = ok_json(drainctl("agents", "--socket", sock, "ls", "--json"))
    before = ok_json(drainctl("agents", "--socket", sock, "--json", "ls"))
    assert isinstance(after, dict) and isinstance(before, dict)
    assert [a["id"] for a in after["agents"]] == [a["id"] for a in before["agents"]] == [agent_id]
    status = ok_json(drainctl("agents", "--socket", sock, "status", "--json"))
    assert isinstance(status, dict) and status["agents"] == 1
    wait_until(lambda: daemon.records()[agent_id].turns >= 1, 30, "a turn")
    drained = ok_json(drainctl("agents", "--socket", sock, "drain", "--grace", "10", "--json"))
    assert isinstance(drained, dict)
    session_dir = drained["agents"][0]["session_dir"]
    resumed = ok_json(drainctl("agents", "--socket", sock, "resume", session_dir, "--json"))
    assert isinstance(resumed, dict) and resumed["id"] == agent_id
    killed = ok_json(drainctl("agents", "--socket", sock, "kill", agent_id, "--json"))
    assert isinstance(killed, dict) and killed["id"] == agent_id
    removed = ok_json(drainctl("agents", "--socket", sock, "rm", agent_id, "--json"))
    assert isinstance(removed, dict) and removed["id"] == agent_id


# ------------------------------------------------------------- pause and wake


def test_pause_and_wake_take_json_kubeconfig_and_context(dev_cluster: Path) -> None:
    """Tried: pause default/t --kubeconfig K --json, wake default/t --kubeconfig K
    --context C --json against the embedded API, and pause of a task that does not exist."""
    if shutil.which("kubectl") is None:
        pytest.skip("needs the kubectl binary")
    manifest = {
        "apiVersion": "caliban.caliban-ai.dev/v1alpha1",
        "kind": "CalibanTask",
        "metadata": {"name": "t", "namespace": "default"},
        "spec": {"task": {"agents": 1}},
    }
    applied = subprocess.run(
        ["kubectl", "--kubeconfig", str(dev_cluster), "apply", "-f", "-"],
        input=json.dumps(manifest), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert applied.returncode == 0, applied.stderr
    context = yaml.safe_load(dev_cluster.read_text())["current-context"]

    paused = ok_json(drainctl("pause", "default/t", "--kubeconfig", str(dev_cluster), "--json"))
    assert isinstance(paused, dict) and paused["spec"]["lifecycle"]["suspend"] is True
    wake = ("wake", "default/t", "--kubeconfig", str(dev_cluster), "--context", context)
    woken = ok_json(drainctl(*wake, "--json"))
    assert isinstance(woken, dict) and woken["spec"]["lifecycle"]["suspend"] is False
    assert "caliban.caliban-ai.dev/wake" in woken["metadata"]["annotations"]
    human = drainctl("pause", "default/t", "--kubeconfig", str(dev_cluster))
    assert human.returncode == ExitCode.OK and human.stdout == "calibantask default/t pausing\n"

    absent = drainctl("pause", "default/nope", "--kubeconfig", str(dev_cluster))
    assert absent.returncode == ExitCode.FAILED and "Traceback" not in absent.stderr
    assert "calibantask default/nope: the API answered 404" in absent.stderr


# ------------------------------------------------------------- the command tree


def _commands(group: click.Group, prefix: str = "drainctl") -> Iterator[tuple[str, click.Command]]:
    for name, command in sorted(group.commands.items()):
        path = f"{prefix} {name}"
        yield path, command
        if isinstance(command, click.Group):
            yield from _commands(command, path)


def test_every_option_has_help_and_every_argument_is_named_in_the_help() -> None:
    """Tried: every command of the tree; each visible option has help text and each
    argument's name appears in its command's help."""
    missing = []
    for path, command in _commands(main):
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden and not param.help:
                missing.append(f"{path} {param.opts[0]}")
            if isinstance(param, click.Argument):
                metavar = (param.name or "").upper()
                if metavar not in (command.help or ""):
                    missing.append(f"{path} {metavar}")
    assert missing == []


def test_log_level_is_the_only_spelling() -> None:
    """Tried: every command that logs; it takes --log-level, and only worker keeps the
    old --loglevel, hidden."""
    spellings: dict[str, list[tuple[str, bool]]] = {}
    for path, command in _commands(main):
        for param in command.params:
            if isinstance(param, click.Option) and any("level" in opt for opt in param.opts):
                spellings.setdefault(path, []).append((param.opts[0], param.hidden))
    assert spellings == {
        "drainctl audit": [("--log-level", False)],
        "drainctl daemon": [("--log-level", False)],
        "drainctl flower": [("--log-level", False)],
        "drainctl dev cluster": [("--log-level", False)],
        "drainctl dev controller": [("--log-level", False)],
        "drainctl dev up": [("--log-level", False)],
        "drainctl operator": [("--log-level", False)],
        "drainctl sources": [("--log-level", False)],
        "drainctl worker": [("--log-level", False), ("--loglevel", True)],
    }


def test_daemon_side_commands_load_no_orchestrator_machinery(tmp_path: Path) -> None:
    """Tried: drainctl daemon --help and agents ... ls (against no daemon) in a fresh
    interpreter; neither kopf, Celery, kombu, SQLAlchemy, Flower, kmock nor the Kubernetes
    client gets imported."""
    probe = (
        "import sys\n"
        "from orchestrator.cli import main\n"
        "for argv in (['daemon', '--help'], ['agents', '--socket', sys.argv[1], 'ls']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = {'kopf', 'celery', 'kombu', 'sqlalchemy', 'alembic', 'flower', 'kmock',\n"
        "         'kubernetes', 'aiohttp'}\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "none.sock")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_ledger_ls_and_show_say_a_snapshot_is_pending_from_its_cut_until_it_is_ready(
    ledger_with_checkpoints: tuple[str, str, str],
) -> None:
    """Tried: one checkpoint's snapshot asked for and not cut yet, the other's cut and not
    ready (a CSI driver still uploading it); then the cut one ready."""
    url, drained, forced = ledger_with_checkpoints
    cut_at = datetime(2026, 12, 6, 9, 0, 2, tzinfo=UTC)
    ledger = Ledger.from_url(url)
    try:
        ledger.record_snapshot(drained, drained, cut_at=cut_at)
        ledger.record_snapshot(forced, forced)
    finally:
        ledger.dispose()
    env = {"DRAIN_DATABASE_URL": url}
    listed = drainctl("ledger", "ls", env=env)
    cells = {row.split()[0]: row.split() for row in listed.stdout.splitlines()[1:]}
    assert (cells[drained][7], cells[forced][7]) == ("pending", "pending")
    shown = drainctl("ledger", "show", drained, env=env).stdout
    assert f"snapshot: {drained} pending: cut 2026-12-06 09:00:02, not readyToUse yet" in shown
    assert (
        f"snapshot: {forced} pending: not cut yet"
        in drainctl("ledger", "show", forced, env=env).stdout
    )
    as_json = ok_json(drainctl("ledger", "show", drained, "--json", env=env))
    assert isinstance(as_json, dict)
    assert (as_json["snapshot_cut_at"], as_json["snapshot_ready_at"]) == (
        "2026-12-06 09:00:02+00:00", None,
    )  # fmt: skip

    ledger = Ledger.from_url(url)
    try:
        ledger.record_snapshot(drained, drained, ready_at=cut_at + timedelta(minutes=3))
    finally:
        ledger.dispose()
    again = drainctl("ledger", "show", drained, env=env).stdout
    assert f"snapshot: {drained} ready: cut 2026-12-06 09:00:02, ready 2026-12-06 09:03:02" in again


def test_ledger_ls_and_show_say_whether_a_checkpoint_has_a_ready_snapshot(
    ledger_with_checkpoints: tuple[str, str, str],
) -> None:
    """Tried: one checkpoint's snapshot ready, the other's failed (never ready in time)."""
    url, drained, forced = ledger_with_checkpoints
    ledger = Ledger.from_url(url)
    try:
        ledger.record_snapshot(drained, drained, ready_at=datetime.now(UTC))
        ledger.record_snapshot(forced, forced, error="not ready within 300s")
    finally:
        ledger.dispose()
    env = {"DRAIN_DATABASE_URL": url}
    listed = drainctl("ledger", "ls", env=env)
    cells = {row.split()[0]: row.split() for row in listed.stdout.splitlines()[1:]}
    assert (cells[drained][7], cells[forced][7]) == ("ready", "failed")
    shown = drainctl("ledger", "show", forced, env=env)
    assert f"snapshot: {forced} failed: not ready within 300s" in shown.stdout
    as_json = ok_json(drainctl("ledger", "ls", "--json", env=env))
    assert isinstance(as_json, list)
    assert {c["ref"]: c["snapshot_name"] for c in as_json} == {drained: drained, forced: forced}
