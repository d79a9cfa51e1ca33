"""How a record is written (``worker_agent.logformat``): the text line, the JSON object,
and which task fields it carries from the process, the code handling a task, a Celery
task's arguments and kopf's per-object logger."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Iterator

import pytest

from worker_agent import logformat
from worker_agent.logformat import (
    ContextFilter,
    JsonFormatter,
    TextFormatter,
    bind_log_context,
    log_context,
    set_log_context,
    task_log_fields,
)


@pytest.fixture(autouse=True)
def no_context() -> Iterator[None]:
    set_log_context()
    logformat._process.clear()
    yield
    set_log_context()
    logformat._process.clear()


def record(
    message: str = "drain_started grace=%s", *args: object, **extra: object
) -> logging.LogRecord:
    made = logging.LogRecord("orchestrator.x", logging.INFO, __file__, 1, message, args or ("3",),
                             None)  # fmt: skip
    for key, value in extra.items():
        setattr(made, key, value)
    ContextFilter().filter(made)
    return made


def test_a_json_line_has_the_level_logger_message_and_the_task_fields() -> None:
    set_log_context(namespace="team-a", name="t1", task_uid="u-1")
    bind_log_context(operation_id="op-9")
    line = JsonFormatter().format(record())
    assert "\n" not in line
    entry = json.loads(line)
    assert entry.pop("ts").endswith("Z")
    assert entry == {
        "level": "INFO", "logger": "orchestrator.x", "message": "drain_started grace=3",
        "namespace": "team-a", "name": "t1", "task_uid": "u-1", "operation_id": "op-9",
    }  # fmt: skip


def test_a_json_line_without_a_task_has_no_task_fields() -> None:
    entry = json.loads(JsonFormatter().format(record()))
    assert set(entry) == {"ts", "level", "logger", "message"}


def test_an_exception_is_one_string_field_of_one_line() -> None:
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        made = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = JsonFormatter().format(made)
    assert len(line.splitlines()) == 1
    entry = json.loads(line)
    assert entry["message"] == "failed"
    assert entry["exc_info"].startswith("Traceback") and "RuntimeError: boom" in entry["exc_info"]


def test_the_text_line_keeps_its_shape_and_appends_the_fields_known() -> None:
    assert (
        TextFormatter()
        .format(record())
        .endswith(" level=INFO logger=orchestrator.x event=drain_started grace=3")
    )
    set_log_context(namespace="team-a", name="t1")
    bind_log_context(operation_id="op-9")
    line = TextFormatter().format(record())
    assert line.startswith("ts=")
    assert line.endswith(" event=drain_started grace=3 ns=team-a name=t1 op=op-9")


def test_kopfs_object_records_carry_their_object() -> None:
    ref = {"apiVersion": "caliban.caliban-ai.dev/v1alpha1", "kind": "CalibanTask",
           "namespace": "team-a", "name": "t1", "uid": "u-1"}  # fmt: skip
    entry = json.loads(
        JsonFormatter().format(record("Timer %s succeeded.", "reconcile", k8s_ref=ref))
    )
    assert (entry["namespace"], entry["name"], entry["task_uid"]) == ("team-a", "t1", "u-1")


def test_the_handlers_fields_win_over_the_process_and_a_block_restores_them() -> None:
    logformat.set_process_context(namespace="team-a", name="t1", task_uid="u-1")
    with log_context(operation_id="op-1"):
        assert logformat.current_context() == {
            "namespace": "team-a", "name": "t1", "task_uid": "u-1", "operation_id": "op-1",
        }  # fmt: skip
        with log_context(operation_id="op-2"):
            assert logformat.current_context()["operation_id"] == "op-2"
        assert logformat.current_context()["operation_id"] == "op-1"
    assert "operation_id" not in logformat.current_context()


def test_a_new_pass_drops_the_operation_an_earlier_one_bound() -> None:
    set_log_context(namespace="a", name="t1", task_uid="u")
    bind_log_context(operation_id="op-1")
    set_log_context(namespace="a", name="t1", task_uid="u")
    assert "operation_id" not in logformat.current_context()


def test_fields_follow_asyncio_tasks_and_threads_but_stay_in_their_task() -> None:
    async def handle(name: str) -> tuple[str, str]:
        set_log_context(namespace="ns", name=name)
        await asyncio.sleep(0)
        in_thread = await asyncio.to_thread(lambda: logformat.current_context()["name"])
        return logformat.current_context()["name"], in_thread

    async def both() -> list[tuple[str, str]]:
        return list(await asyncio.gather(handle("one"), handle("two")))

    assert asyncio.run(both()) == [("one", "one"), ("two", "two")]
    assert logformat.current_context() == {}


def test_an_unknown_field_is_a_bug_not_a_silent_drop() -> None:
    with pytest.raises(ValueError, match="not log context fields: password"):
        bind_log_context(password="hunter2")


@pytest.mark.parametrize(
    ("args", "kwargs", "fields"),
    [
        pytest.param((), {"op_id": "op-1", "grace_secs": 30, "task_uid": "u-1"},
                     {"operation_id": "op-1", "task_uid": "u-1"}, id="daemon-drain"),
        pytest.param(({"op_id": "op-1", "namespace": "a", "name": "t1", "task_uid": "u-1",
                       "refs": []},), {"op_id": "op-1", "reason": "delete"},
                     {"operation_id": "op-1", "namespace": "a", "name": "t1", "task_uid": "u-1"},
                     id="record-checkpoint-after-a-drain"),
        pytest.param((), {"namespace": "a", "name": "t1", "task_uid": None, "agents_live": 2},
                     {"namespace": "a", "name": "t1"}, id="activity-without-uid"),
        pytest.param(("not a payload",), None, {}, id="nothing-named"),
    ],
)  # fmt: skip
def test_a_celery_tasks_fields_come_from_its_arguments(
    args: tuple[object, ...], kwargs: object, fields: dict[str, str]
) -> None:
    assert task_log_fields(args, kwargs) == fields
