"""``drainctl``'s exit codes and its one-line errors, tried for real: subprocesses
against a real Redis, real SQLite files, a real PostgreSQL URL on a closed port, and a
kubeconfig pointing at a closed port. Each test says what was tried; each failure must
end in exactly one ``Error:`` line on stderr, the documented exit code, and no traceback.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from orchestrator.cli import ExitCode
from orchestrator.ledger import Ledger
from tests.integration.cli_support import drainctl
from tests.pipeline_support import free_port, fresh_sqlite, redis_db_url

CLOSED_PORT_PG = "postgresql+psycopg://postgres@127.0.0.1:1/x"
CLOSED_PORT_REDIS = "redis://127.0.0.1:1/0"


def assert_one_line_error(
    result: subprocess.CompletedProcess[str], code: ExitCode, *fragments: str
) -> None:
    """Exit ``code``, one ``Error: …`` line on stderr holding every fragment, no traceback."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture
def ledger_url(tmp_path: Path) -> str:
    return fresh_sqlite(tmp_path)


# ------------------------------------------------------------------ the exit codes


def test_exit_0_when_the_schema_is_migrated(tmp_path: Path) -> None:
    """Tried: drainctl db upgrade on a new SQLite file."""
    result = drainctl("db", "upgrade", env={"DRAIN_DATABASE_URL": f"sqlite:///{tmp_path}/l.db"})
    assert result.returncode == ExitCode.OK, result.stderr
    assert result.stdout.startswith("ledger at revision ")


def test_exit_1_when_the_operation_fails(ledger_url: str) -> None:
    """Tried: resume --checkpoint ckpt-unknown --wait (a ref the ledger never recorded)."""
    env = {"DRAIN_DATABASE_URL": ledger_url, "DRAIN_BROKER_URL": redis_db_url()}
    result = drainctl("resume", "ns/task", "--checkpoint", "ckpt-unknown", "--wait", env=env)
    assert_one_line_error(result, ExitCode.FAILED, "of ns/task failed", "ckpt-unknown")


def test_exit_2_for_a_usage_error() -> None:
    """Tried: drain with an argument that is not NAMESPACE/NAME (click's own usage error)."""
    result = drainctl("drain", "not-a-ref")
    assert result.returncode == ExitCode.USAGE
    assert "is not NAMESPACE/NAME" in result.stderr and "Traceback" not in result.stderr


def test_exit_3_when_waiting_runs_out_of_timeout(ledger_url: str) -> None:
    """Tried: drain ns/idle --wait --timeout 1 against a queue no daemon consumes."""
    env = {"DRAIN_DATABASE_URL": ledger_url, "DRAIN_BROKER_URL": redis_db_url()}
    result = drainctl("drain", "ns/idle", "--wait", "--timeout", "1", "--json", env=env)
    assert_one_line_error(result, ExitCode.TIMED_OUT, "of ns/idle is still draining", "--timeout")
    assert '"state": "draining"' in result.stdout  # --json prints the unfinished row too


def test_exit_4_and_no_operation_when_the_broker_is_unreachable(ledger_url: str) -> None:
    """Tried: drain ns/x with DRAIN_BROKER_URL on a closed port; the publish must not
    retry for long, and no operation row may be left behind."""
    env = {"DRAIN_DATABASE_URL": ledger_url, "DRAIN_BROKER_URL": CLOSED_PORT_REDIS}
    result = drainctl("drain", "ns/x", env=env, timeout=30)
    assert_one_line_error(
        result, ExitCode.UNREACHABLE, "cannot reach the broker at redis://127.0.0.1:1/0"
    )
    ledger = Ledger.from_url(ledger_url)
    try:
        assert ledger.list_operations(namespace="ns", name="x") == []
    finally:
        ledger.dispose()


# ------------------------------------------------------- the errors of item 5, each


def test_unreachable_database_is_one_line(tmp_path: Path) -> None:
    """Tried: ledger ls with DRAIN_DATABASE_URL on a PostgreSQL port nobody listens on."""
    result = drainctl("ledger", "ls", env={"DRAIN_DATABASE_URL": CLOSED_PORT_PG})
    assert_one_line_error(
        result, ExitCode.UNREACHABLE, "cannot reach the ledger database", "127.0.0.1:1"
    )


def test_unmigrated_schema_says_to_run_db_upgrade(tmp_path: Path) -> None:
    """Tried: ledger ls on an empty SQLite file that drainctl db upgrade never saw."""
    empty = tmp_path / "empty.db"
    empty.touch()
    result = drainctl("ledger", "ls", env={"DRAIN_DATABASE_URL": f"sqlite:///{empty}"})
    assert_one_line_error(result, ExitCode.FAILED, "has no schema yet", "run drainctl db upgrade")


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("not a url", "is not a SQLAlchemy URL"),
        ("mysql://user@127.0.0.1/db", "not 'mysql'"),
    ],
    ids=["not-a-url", "unsupported-backend"],
)
def test_malformed_database_url_is_one_line(url: str, fragment: str) -> None:
    """Tried: ledger ls with a DRAIN_DATABASE_URL that is no URL / names another database."""
    result = drainctl("ledger", "ls", env={"DRAIN_DATABASE_URL": url})
    assert_one_line_error(result, ExitCode.USAGE, "DRAIN_DATABASE_URL", fragment)


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("nope://127.0.0.1/0", "is not a broker URL"),
        ("redis://127.0.0.1:notaport/0", "is malformed"),
    ],
    ids=["unknown-scheme", "bad-port"],
)
def test_malformed_broker_url_is_one_line(ledger_url: str, url: str, fragment: str) -> None:
    """Tried: drain ns/x with a DRAIN_BROKER_URL kombu cannot use."""
    env = {"DRAIN_DATABASE_URL": ledger_url, "DRAIN_BROKER_URL": url}
    result = drainctl("drain", "ns/x", env=env)
    assert_one_line_error(result, ExitCode.USAGE, "DRAIN_BROKER_URL", fragment)


def test_bad_settings_value_is_one_line(ledger_url: str) -> None:
    """Tried: ledger ls with DRAIN_DEFAULT_GRACE_SECS=-1 (pydantic refuses it)."""
    env = {"DRAIN_DATABASE_URL": ledger_url, "DRAIN_DEFAULT_GRACE_SECS": "-1"}
    result = drainctl("ledger", "ls", env=env)
    assert_one_line_error(
        result, ExitCode.USAGE, "invalid settings", "DRAIN_DEFAULT_GRACE_SECS", "'-1'"
    )


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        # A check across settings: pydantic hands the error every value it read.
        ("DRAIN_DRAIN_EXPIRES_SECS", "1"),
        # A check of the URL itself, which holds the password.
        ("DRAIN_RESULT_BACKEND", "rpc://guest:hunter2-secret@127.0.0.1//"),
    ],
    ids=["across-settings", "the-url-itself"],
)
def test_a_settings_error_never_shows_a_password(ledger_url: str, setting: str, value: str) -> None:
    """Tried: a broker URL with a password beside a setting that makes the settings
    invalid (a drain expiry shorter than redelivery), and a result backend URL with a
    password that is refused."""
    env = {
        "DRAIN_DATABASE_URL": ledger_url,
        "DRAIN_BROKER_URL": "amqp://guest:hunter2-secret@127.0.0.1:5672//",
        "DRAIN_RESULT_BACKEND": "redis://:hunter2-secret@127.0.0.1:6379/3",
        setting: value,
    }
    result = drainctl("ledger", "ls", env=env)
    assert_one_line_error(result, ExitCode.USAGE, "invalid settings", setting)
    assert "hunter2-secret" not in result.stderr + result.stdout


def test_bad_daemon_settings_are_one_line(tmp_path: Path) -> None:
    """Tried: drainctl daemon --drain-grace -5 (DaemonSettings refuses it)."""
    result = drainctl("daemon", "--store", str(tmp_path), "--drain-grace", "-5")
    assert_one_line_error(result, ExitCode.USAGE, "invalid settings", "DRAIN_DAEMON_DRAIN_GRACE")


def test_missing_kubeconfig_is_one_line(tmp_path: Path) -> None:
    """Tried: pause ns/x with KUBECONFIG naming a file that does not exist, outside a pod."""
    result = drainctl("pause", "ns/x", env={"KUBECONFIG": str(tmp_path / "absent")})
    assert_one_line_error(result, ExitCode.USAGE, "no usable Kubernetes configuration")


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "{server}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: here, context: {{cluster: c, user: u}}}}]
current-context: here
"""
    )
    return path


@pytest.mark.parametrize("verb", ["pause", "wake"])
def test_unreachable_kubernetes_api_is_one_line(tmp_path: Path, verb: str) -> None:
    """Tried: pause/wake ns/x --kubeconfig K where K's server is a closed local port."""
    port = free_port()
    kubeconfig = write_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{port}")
    result = drainctl(verb, "ns/x", "--kubeconfig", str(kubeconfig), timeout=60)
    assert_one_line_error(
        result, ExitCode.UNREACHABLE, "cannot reach the Kubernetes API", f"127.0.0.1:{port}"
    )


def test_unknown_kube_context_is_one_line(tmp_path: Path) -> None:
    """Tried: wake ns/x --kubeconfig K --context nowhere (K has only context "here")."""
    kubeconfig = write_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{free_port()}")
    result = drainctl("wake", "ns/x", "--kubeconfig", str(kubeconfig), "--context", "nowhere")
    assert_one_line_error(result, ExitCode.USAGE, "no usable Kubernetes configuration", "nowhere")


def test_unreachable_daemon_socket_is_one_line(tmp_path: Path) -> None:
    """Tried: agents --socket S ls --json where nothing listens on S."""
    result = drainctl("agents", "--socket", str(tmp_path / "none.sock"), "ls", "--json")
    assert_one_line_error(result, ExitCode.UNREACHABLE, "cannot connect to the daemon")


def test_ledger_prune_with_an_unreachable_kubernetes_api_is_one_line_and_changes_nothing(
    tmp_path: Path, ledger_url: str
) -> None:
    """Tried: ledger prune --keep 0 --kubeconfig K (K's server a closed local port) on a
    ledger with one checkpoint: nothing may be marked released when nothing was."""
    from orchestrator.ledger import CheckpointReason, Ledger, OperationKind

    ledger = Ledger.from_url(ledger_url)
    try:
        op = ledger.begin_operation(OperationKind.DRAIN, task_uid="u", namespace="ns",
                                    name="t", idempotency_key="k")  # fmt: skip
        ref = ledger.record_checkpoint(op.id, [], reason=CheckpointReason.MANUAL).ref
        port = free_port()
        kubeconfig = write_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{port}")
        result = drainctl("ledger", "prune", "--keep", "0", "--kubeconfig", str(kubeconfig),
                          env={"DRAIN_DATABASE_URL": ledger_url}, timeout=60)  # fmt: skip
        assert_one_line_error(
            result, ExitCode.UNREACHABLE, "cannot reach the Kubernetes API", f"127.0.0.1:{port}"
        )
        assert ledger.get_checkpoint(ref).available  # type: ignore[union-attr]
    finally:
        ledger.dispose()


@pytest.mark.parametrize("older_than", ["banana", "7 days", "-1d", "1w"])
def test_ledger_prune_with_a_bad_duration_is_a_usage_error(
    ledger_url: str, older_than: str
) -> None:
    """Tried: ledger prune --older-than with what is not a duration like 12h or 7d."""
    result = drainctl("ledger", "prune", "--older-than", older_than,
                      env={"DRAIN_DATABASE_URL": ledger_url})  # fmt: skip
    assert result.returncode == ExitCode.USAGE
    assert "is not a duration like 12h, 7d or 1h30m" in result.stderr
    assert "Traceback" not in result.stderr


def test_ledger_prune_without_kubeconfig_is_one_line(tmp_path: Path, ledger_url: str) -> None:
    """Tried: ledger prune outside a pod with KUBECONFIG naming a file that does not exist."""
    result = drainctl("ledger", "prune", env={"DRAIN_DATABASE_URL": ledger_url,
                                              "KUBECONFIG": str(tmp_path / "absent")})  # fmt: skip
    assert_one_line_error(result, ExitCode.USAGE, "no usable Kubernetes configuration")


# ----------------------------------------------------------------------- audit


def test_audit_with_an_unreachable_kubernetes_api_is_one_line(
    tmp_path: Path, ledger_url: str
) -> None:
    """Tried: drainctl audit --kubeconfig K, K's server a closed local port."""
    kubeconfig = write_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{free_port()}")
    result = drainctl("audit", "--kubeconfig", str(kubeconfig),
                      env={"DRAIN_DATABASE_URL": ledger_url}, timeout=60)  # fmt: skip
    assert_one_line_error(result, ExitCode.UNREACHABLE, "cannot reach the Kubernetes API")


def test_audit_with_an_unreachable_database_is_one_line() -> None:
    """Tried: drainctl audit --no-kubernetes with the ledger on a closed local port."""
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test"
    result = drainctl("audit", "--no-kubernetes", env={"DRAIN_DATABASE_URL": url}, timeout=60)
    assert_one_line_error(result, ExitCode.UNREACHABLE, "cannot reach the ledger database")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--metrics-port", "9464"], "--metrics-port and --report-file need --every"),
        (["--report-file", "r.json"], "--metrics-port and --report-file need --every"),
        (["--every", "0"], "0.0 is not in the range x>=1.0"),
        (["--every", "soon"], "'soon' is not a valid float"),
        (["--metrics-port", "70000", "--every", "5"], "70000 is not in the range"),
        (["--volumes", "/nonexistent/volumes"], "'/nonexistent/volumes' does not exist"),
    ],
)
def test_audit_bad_options_are_usage_errors(
    ledger_url: str, args: list[str], fragment: str
) -> None:
    """Tried: drainctl audit with options that cannot work together or are not values."""
    result = drainctl("audit", "--no-kubernetes", *args, env={"DRAIN_DATABASE_URL": ledger_url})
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr


def test_audit_of_a_clean_ledger_exits_0_and_of_a_broken_one_1(ledger_url: str) -> None:
    """Tried: drainctl audit --no-kubernetes --json on an empty ledger (clean, exit 0),
    then with an operation left past its deadline (exit 1, one finding, one Error line)."""
    from datetime import UTC, datetime, timedelta

    from orchestrator.ledger import Ledger, OperationKind

    clean = drainctl("audit", "--no-kubernetes", "--json", env={"DRAIN_DATABASE_URL": ledger_url})
    assert clean.returncode == ExitCode.OK, clean.stderr
    assert json.loads(clean.stdout)["clean"] is True
    ledger = Ledger.from_url(ledger_url)
    try:
        op = ledger.begin_operation(
            OperationKind.DRAIN, task_uid="u", namespace="ns", name="t", idempotency_key="k",
            deadline_at=datetime.now(UTC) - timedelta(hours=1),
        )  # fmt: skip
    finally:
        ledger.dispose()
    broken = drainctl("audit", "--no-kubernetes", "--json", env={"DRAIN_DATABASE_URL": ledger_url})
    assert_one_line_error(broken, ExitCode.FAILED, "the audit found 1 inconsistency")
    findings = json.loads(broken.stdout)["findings"]
    assert [(f["kind"], f["subject"]) for f in findings] == [
        ("OperationOverdue", f"operation {op.id}")
    ]
    human = drainctl("audit", "--no-kubernetes", env={"DRAIN_DATABASE_URL": ledger_url})
    assert f"OperationOverdue     operation {op.id}" in human.stdout
