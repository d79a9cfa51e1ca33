"""How every caliban-drain process writes its logs: one line per record on stderr, as
readable ``key=value`` text (the default) or as one JSON object (``DRAIN_LOG_FORMAT=json``).

It lives on the daemon side so both halves can use it: ``drainctl`` configures every
command through ``orchestrator.cli.output.configure_logging``, which calls
:func:`configure` here, and the daemon's Celery consumer (a child that never imports
``orchestrator``) calls it itself.

A record carries the task it concerns — ``namespace``, ``name``, ``task_uid`` and
``operation_id`` — wherever that is known, from three places, later ones winning:

- the process (:func:`set_process_context`): a daemon or its consumer serves one task;
- the code handling a task (:func:`set_log_context`, :func:`bind_log_context`,
  :func:`log_context`): contextvars, so they follow ``asyncio`` tasks and
  ``asyncio.to_thread`` and never leak from one kopf handler's object into another's;
  a Celery task's come from its arguments (:func:`install_celery_hooks`);
- kopf's per-object logger, whose records hold the object in ``k8s_ref``.

Fields never include secrets or payloads: only these names, the level, the logger and
the message.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Final, Literal

from pydantic_settings import BaseSettings, SettingsConfigDict

CONTEXT_FIELDS: Final = ("namespace", "name", "task_uid", "operation_id")
"""The task fields a record carries when known, in the order they are written."""

TEXT_KEYS: Final = {"namespace": "ns", "name": "name", "task_uid": "uid", "operation_id": "op"}
"""How the text format spells each field (short, as in the rest of the line)."""

TEXT_FORMAT: Final = "ts=%(asctime)s level=%(levelname)s logger=%(name)s event=%(message)s"

_TASK_ARG_KEYS: Final = {
    "namespace": "namespace",
    "name": "name",
    "task_uid": "task_uid",
    "op_id": "operation_id",
}
"""Celery payload keys (``worker_agent.contract``) → the field each one fills."""


LOG_FORMAT_ENV: Final = "DRAIN_LOG_FORMAT"


class LogSettings(BaseSettings):
    """``DRAIN_LOG_FORMAT``: ``text`` (``ts=… level=… logger=… event=…``) or ``json``."""

    model_config = SettingsConfigDict(env_prefix="DRAIN_", extra="ignore")

    log_format: Literal["text", "json"] = "text"


_NONE: Final[Mapping[str, str]] = MappingProxyType({})
_context: ContextVar[Mapping[str, str]] = ContextVar("drain_log_context", default=_NONE)
_process: dict[str, str] = {}


def _fields(fields: Mapping[str, object]) -> dict[str, str]:
    unknown = set(fields) - set(CONTEXT_FIELDS)
    if unknown:
        raise ValueError(f"not log context fields: {', '.join(sorted(unknown))}")
    return {k: str(v) for k, v in fields.items() if v is not None and str(v)}


def set_process_context(**fields: object) -> None:
    """Fields every record of this process carries (a daemon's task)."""
    _process.update(_fields(fields))


def set_log_context(**fields: object) -> None:
    """Replace the current context with ``fields``: the start of one task's handling,
    which drops what an earlier pass in the same asyncio task had bound."""
    _context.set(_fields(fields))


def bind_log_context(**fields: object) -> None:
    """Add ``fields`` to the current context (an operation id, once it is known)."""
    _context.set({**_context.get(), **_fields(fields)})


@contextlib.contextmanager
def log_context(**fields: object) -> Iterator[None]:
    """``fields`` added for the duration of the block."""
    token = _context.set({**_context.get(), **_fields(fields)})
    try:
        yield
    finally:
        _context.reset(token)


def current_context(record: logging.LogRecord | None = None) -> dict[str, str]:
    """The fields a record made now carries: the process's, kopf's object's, then those
    of the code handling a task."""
    found = dict(_process)
    ref = getattr(record, "k8s_ref", None)
    if isinstance(ref, Mapping):
        found |= _fields(
            {"namespace": ref.get("namespace"), "name": ref.get("name"), "task_uid": ref.get("uid")}
        )
    return found | dict(_context.get())


class ContextFilter(logging.Filter):
    """Puts :func:`current_context` on each record as ``drain_context`` (a handler's
    filter, so it sees records of every logger, kopf's and Celery's included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "drain_context"):
            record.drain_context = current_context(record)
        return True


def _context_of(record: logging.LogRecord) -> dict[str, str]:
    found = getattr(record, "drain_context", None)
    return dict(found) if isinstance(found, Mapping) else current_context(record)


class TextFormatter(logging.Formatter):
    """``ts=… level=… logger=… event=<message>``, then ``ns=… name=… uid=… op=…`` for
    the fields known."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        context = _context_of(record)
        extra = " ".join(f"{TEXT_KEYS[k]}={context[k]}" for k in CONTEXT_FIELDS if k in context)
        return f"{line} {extra}" if extra else line


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``ts`` (UTC, ISO 8601), ``level``,
    ``logger``, ``message``, the context fields known, and ``exc_info`` / ``stack_info``
    as strings when the record has them."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }  # fmt: skip
        context = _context_of(record)
        entry |= {k: context[k] for k in CONTEXT_FIELDS if k in context}
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc_info"] = record.exc_text
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def formatter(log_format: str) -> logging.Formatter:
    return JsonFormatter() if log_format == "json" else TextFormatter()


def configure(level: str, log_format: str | None = None) -> None:
    """Root logging to stderr in ``log_format`` (None: ``DRAIN_LOG_FORMAT``, whose bad
    value raises pydantic's ``ValidationError``, reported as one line by ``drainctl``).
    Like ``logging.basicConfig``, a root logger that already has handlers is kept."""
    chosen = log_format or LogSettings().log_format
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(formatter(chosen))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    logging.captureWarnings(True)  # a library's warning is a record too, not a bare line


def quiet_worker(log_format: str | None = None) -> bool:
    """Whether a Celery worker started here goes without its start-up banner: in JSON,
    since the banner is printed, not logged, and would be the only lines that are not
    JSON objects (its ``… ready.`` record stays)."""
    chosen = log_format or LogSettings().log_format
    return chosen == "json"


def task_log_fields(args: object, kwargs: object) -> dict[str, str]:
    """The context fields a Celery task's arguments name: its keyword arguments, then
    a payload passed as a positional dict (a chain's previous result)."""
    sources = [kwargs] if isinstance(kwargs, Mapping) else []
    if isinstance(args, list | tuple):
        sources += [a for a in args if isinstance(a, Mapping)]
    found: dict[str, str] = {}
    for source in reversed(sources):
        for key, field in _TASK_ARG_KEYS.items():
            value = source.get(key)
            if isinstance(value, str) and value:
                found[field] = value
    return found


_task_tokens: dict[str, Token[Mapping[str, str]]] = {}


def _task_started(
    task_id: str | None = None, args: object = (), kwargs: object = None, **_: object
) -> None:
    token = _context.set({**_context.get(), **task_log_fields(args, kwargs)})
    if task_id is not None:
        _task_tokens[task_id] = token


def _task_finished(task_id: str | None = None, **_: object) -> None:
    token = _task_tokens.pop(task_id, None) if task_id is not None else None
    if token is not None:
        with contextlib.suppress(ValueError):  # made in another context: nothing to undo
            _context.reset(token)


def _leave_logging_alone(**_: object) -> None:
    """A ``setup_logging`` receiver: with one connected, Celery configures no logging
    at all, so :func:`configure`'s handler formats its records too."""


def _say_as_json(message: str, f: Any = None) -> None:
    """Celery's ``safe_say`` (its shutdown notices, printed from a signal handler, not
    logged) as one JSON object; one ``os.write``, safe in a signal handler as the
    original is."""
    line = JsonFormatter().format(
        logging.LogRecord("celery.apps.worker", logging.WARNING, __file__, 0, message, (), None)
    )
    stream = f if f is not None else sys.__stderr__
    if stream is None:
        return
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.write(stream.fileno(), f"{line}\n".encode())


def install_celery_hooks(log_format: str | None = None) -> None:
    """In a Celery worker: keep Celery's own logging setup out, give every task's
    records the fields its arguments name for the time it runs, and in JSON turn
    Celery's printed shutdown notices into JSON lines too."""
    from celery import signals
    from celery.apps import worker

    signals.setup_logging.connect(_leave_logging_alone, weak=False)
    signals.task_prerun.connect(_task_started, weak=False)
    signals.task_postrun.connect(_task_finished, weak=False)
    if (log_format or LogSettings().log_format) == "json":
        worker.safe_say = _say_as_json  # type: ignore[attr-defined]
