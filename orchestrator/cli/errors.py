"""``drainctl``'s exit codes and the one path from an exception to a one-line error.

Every command runs inside ``DrainctlGroup.invoke``, which turns the failures a user can
meet — an unreachable broker, database, Kubernetes API or daemon socket, a ledger whose
schema was never created, a malformed URL, bad settings — into one ``Error: …`` line on
stderr and an ``ExitCode``. Commands raise the ``DrainctlError`` subclasses below for
their own refusals and let library exceptions through; nothing is caught per command.

The translation matches exception classes by their qualified *names* along the MRO, so
this module imports neither SQLAlchemy, Celery, kombu, redis nor the Kubernetes client:
``drainctl daemon`` must load the daemon side only. An exception that is not recognised
keeps its traceback, because it is a bug to fix, not a condition to explain.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterator
from typing import Any

import click


class ExitCode(enum.IntEnum):
    """What ``drainctl`` exits with; ``docs/cli.md`` has the same table."""

    OK = 0
    """Done."""
    FAILED = 1
    """The operation ran and failed (a drain that failed, a refused daemon request,
    an object that does not exist, a ledger schema not created yet)."""
    USAGE = 2
    """Bad arguments (click's own usage errors) or bad configuration: a malformed URL,
    an invalid ``DRAIN_*`` value, no kubeconfig. Retrying unchanged cannot help."""
    TIMED_OUT = 3
    """``--wait`` ran out of ``--timeout`` before the operation finished."""
    UNREACHABLE = 4
    """Cannot reach the broker, the database, the Kubernetes API or the daemon socket."""


class DrainctlError(click.ClickException):
    """A failure ``drainctl`` explains in one line; ``exit_code`` says which kind."""

    exit_code = ExitCode.FAILED


class OperationFailed(DrainctlError):
    exit_code = ExitCode.FAILED


class Misconfigured(DrainctlError):
    exit_code = ExitCode.USAGE


class TimedOut(DrainctlError):
    exit_code = ExitCode.TIMED_OUT


class Unreachable(DrainctlError):
    exit_code = ExitCode.UNREACHABLE


def _class_names(exc: BaseException) -> Iterator[str]:
    for cls in type(exc).__mro__:
        yield f"{cls.__module__}.{cls.__qualname__}"


def _is(exc: BaseException, *names: str) -> bool:
    return any(name in names for name in _class_names(exc))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        line = line.strip()
        # SQLAlchemy prefixes the driver's class: "(psycopg.OperationalError) connection …"
        line = re.sub(r"^\([\w.]+\)\s*", "", line)
        if line:
            return line.rstrip(".")
    return type(exc).__name__


def _settings_url(field: str) -> str:
    """The configured URL ``field`` of the orchestrator settings, password hidden, or ``?``
    when the settings are not loaded (this module never loads them itself)."""
    import sys

    module = sys.modules.get("orchestrator.settings")
    if module is None:
        return "?"
    try:
        value = str(getattr(module.get_settings(), field))
    except Exception:  # settings that fail to load are reported as themselves
        return "?"
    return hide_password(value)


def hide_password(url: str) -> str:
    """``scheme://user:secret@host`` → ``scheme://user:***@host``; other text unchanged."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


def _shown_input(value: Any) -> str:
    """What a refused value is shown as: a URL without its password; nothing for a whole
    model's input (a check across settings gets every value read, secrets among them)."""
    if isinstance(value, dict | list):
        return ""
    if isinstance(value, str):
        value = hide_password(value)
    return f" (got {value!r})"


def _validation_error(exc: Any) -> DrainctlError:
    """A pydantic ``ValidationError`` of a settings model as one line naming each field
    by the environment variable that sets it."""
    prefixes = {"Settings": "DRAIN_", "DaemonSettings": "DRAIN_DAEMON_", "LogSettings": "DRAIN_"}
    prefix = prefixes.get(str(getattr(exc, "title", "")), "")
    problems = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error.get("loc", ()))
        message = hide_password(str(error.get("msg", "invalid")))
        if not field:  # a check across settings: its message names the variables
            problems.append(message.removeprefix("Value error, "))
            continue
        name = f"{prefix}{field.upper()}" if prefix else field
        problems.append(f"{name}: {message}{_shown_input(error.get('input'))}")
    return Misconfigured(
        f"invalid settings: {'; '.join(problems)}; fix the environment variable or option"
    )


def _database_error(exc: BaseException) -> DrainctlError:
    detail = _first_line(exc)
    missing_table = re.search(r"no such table|relation \S+ does not exist|UndefinedTable", str(exc))
    if missing_table:
        return OperationFailed(
            f"the ledger at {_settings_url('database_url')} has no schema yet ({detail}); "
            "run drainctl db upgrade"
        )
    return Unreachable(
        f"cannot reach the ledger database at {_settings_url('database_url')}: {detail}; "
        "check DRAIN_DATABASE_URL and that the database is running"
    )


def _kubernetes_unreachable(exc: BaseException) -> DrainctlError:
    # urllib3 (the official client) names the pool; aiohttp (``kubernetes_asyncio``, the
    # operator's calls, which ``drainctl ledger prune`` makes) the host and port.
    pool = getattr(exc, "pool", None)
    host, port = (pool.host, pool.port) if pool is not None else (
        getattr(exc, "host", None), getattr(exc, "port", None))  # fmt: skip
    where = f"{host}:{port}" if host is not None else "the configured server"
    reason = getattr(exc, "reason", None) or getattr(exc, "os_error", None) or exc
    return Unreachable(
        f"cannot reach the Kubernetes API at {where}: {_first_line(reason)}; "
        "check --kubeconfig/--context (or KUBECONFIG) and that the API server is running"
    )


Translator = Callable[[BaseException], DrainctlError]

_TRANSLATIONS: tuple[tuple[tuple[str, ...], Translator], ...] = (
    (
        ("pydantic_core._pydantic_core.ValidationError",),
        _validation_error,
    ),
    (
        ("sqlalchemy.exc.OperationalError", "sqlalchemy.exc.ProgrammingError"),
        _database_error,
    ),
    (
        ("sqlalchemy.exc.ArgumentError", "sqlalchemy.exc.NoSuchModuleError"),
        lambda exc: Misconfigured(
            f"DRAIN_DATABASE_URL is not a usable database URL ({_first_line(exc)}); "
            "use sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DB"
        ),
    ),
    (
        (
            "kombu.exceptions.OperationalError",
            "redis.exceptions.ConnectionError",
            "redis.exceptions.TimeoutError",
        ),
        lambda exc: Unreachable(
            f"cannot reach the broker at {_settings_url('broker_url')}: {_first_line(exc)}; "
            "check DRAIN_BROKER_URL and that the broker is running"
        ),
    ),
    (
        ("kubernetes.config.config_exception.ConfigException",),
        lambda exc: Misconfigured(
            f"no usable Kubernetes configuration: {_first_line(exc)}; pass --kubeconfig "
            "(and --context) or set KUBECONFIG"
        ),
    ),
    (
        (
            "urllib3.exceptions.MaxRetryError",
            "urllib3.exceptions.NewConnectionError",
            "aiohttp.client_exceptions.ClientConnectorError",
        ),
        _kubernetes_unreachable,
    ),
    (
        ("worker_agent.server.ConfigError",),
        lambda exc: Misconfigured(f"the daemon cannot start: {_first_line(exc)}"),
    ),
    (
        ("worker_agent.client.ControlError",),
        lambda exc: OperationFailed(f"the daemon refused: {_first_line(exc)}"),
    ),
    (
        ("worker_agent.client.PromptRefused",),
        lambda exc: OperationFailed(_first_line(exc)),
    ),
    (
        # The daemon client's own ConnectionError ("cannot connect to the daemon at …").
        ("builtins.ConnectionError",),
        lambda exc: Unreachable(f"{_first_line(exc)}; is the daemon running?"),
    ),
)


def translate(exc: BaseException) -> DrainctlError | None:
    """The one-line error for a failure a user can meet, or None for a bug."""
    if isinstance(exc, DrainctlError):
        return exc
    for names, translator in _TRANSLATIONS:
        if _is(exc, *names):
            return translator(exc)
    if isinstance(exc, RuntimeError) and "Celery result store" in str(exc):
        # Celery gives up on an unreachable Redis result backend with a bare RuntimeError.
        return Unreachable(
            f"cannot reach the result backend of {_settings_url('broker_url')}; "
            "check DRAIN_RESULT_BACKEND / DRAIN_BROKER_URL and that Redis is running"
        )
    return None


class DrainctlGroup(click.Group):
    """The top-level group: every subcommand runs inside its ``invoke``, so this is the
    single place where known failures become an ``Error:`` line and an exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort, click.ClickException):
            raise
        except Exception as exc:
            error = translate(exc)
            if error is None:
                raise
            raise error from None


def require_extra(extra: str, module: str, what: str) -> None:
    """One line, not a traceback, when ``what`` needs an extra that is not installed."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise Misconfigured(
            f"{what} needs the {extra!r} extra, which is not installed: "
            f"pip install 'caliban-drain[{extra}]'"
        )
