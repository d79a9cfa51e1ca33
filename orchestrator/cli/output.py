"""What every ``drainctl`` command shares: ``--json``, ``--log-level``, ``NS/NAME``, and
how a result is printed.

``--json`` is one option object put on every command that prints *and* on the groups
that always had it (``agents``, ``ledger``), so ``drainctl ledger ls --json`` and
``drainctl ledger --json ls`` mean the same. It writes into ``ctx.meta``, which click
shares between a context and all its children: a flag given anywhere on the command
line is seen by the command that prints. Human output is for people and may change;
the JSON is for scripts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

_JSON_KEY = "drainctl.json"

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _remember_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.meta[_JSON_KEY] = True


def json_option(command: F) -> F:
    """``--json``: print the result as JSON (accepted after the command or its group)."""
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        expose_value=False,
        callback=_remember_json,
        help="Print the result as JSON instead of a table or a sentence.",
    )(command)


def wants_json() -> bool:
    """Whether ``--json`` was given anywhere on this command line."""
    return bool(click.get_current_context().meta.get(_JSON_KEY, False))


def jsonable(value: Any) -> Any:
    """Ledger views (frozen dataclasses) and protocol replies (pydantic) as plain data."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    return value


def emit(result: Any, human: str | Callable[[], str]) -> None:
    """Print ``result`` as JSON under ``--json``, else the human text."""
    if wants_json():
        click.echo(json.dumps(jsonable(result), indent=2, default=str))
    else:
        click.echo(human() if callable(human) else human)


def log_level_option(command: F) -> F:
    """``--log-level``: the one spelling for every command that logs."""
    return click.option(
        "--log-level",
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        default="INFO",
        show_default=True,
        help="Log threshold; logs go to stderr as key=value lines (DRAIN_LOG_FORMAT=json: JSON).",
    )(command)


def configure_logging(level: str) -> None:
    """The one place a ``drainctl`` process configures logging: stderr, in the format
    ``DRAIN_LOG_FORMAT`` names (``text``, the default, or ``json``; see
    ``worker_agent.logformat``). A bad value exits 2 with one line (``errors.py``)."""
    from worker_agent.logformat import configure

    configure(level)


class TaskRef(click.ParamType):  # type: ignore[type-arg]
    """``NAMESPACE/NAME`` of a CalibanTask, checked like Kubernetes names → (ns, name)."""

    name = "NS/NAME"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[str, str]:
        if isinstance(value, tuple):
            return value  # a default already converted
        from orchestrator.pipeline.app import TaskNameError, parse_task_ref

        try:
            return parse_task_ref(str(value))
        except TaskNameError as exc:
            self.fail(str(exc), param, ctx)


TASK_REF = TaskRef()
