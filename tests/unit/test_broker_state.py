"""The daemon consumer's broker report (``worker_agent.broker_state``): what it says for
each connection state and check, what ``/readyz`` makes of it, and the file between."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker_agent.broker_state import (
    REPORT_FILE,
    Connection,
    Report,
    problem,
    read,
    verdict,
    write,
)

REFUSED = "Error 111 connecting to 127.0.0.1:6379. Connection refused."


@pytest.mark.parametrize(
    ("connection", "check_error", "expected"),
    [
        (Connection.CONNECTED, None, None),
        (
            Connection.CONNECTED,
            "Timeout reading from socket",
            "the consumer's broker does not answer: Timeout reading from socket",
        ),
        (
            Connection.NOT_YET,
            REFUSED,
            f"the consumer is not connected to the broker yet: {REFUSED}",
        ),
        (Connection.NOT_YET, None, "the consumer is not connected to the broker yet"),
        (
            Connection.LOST,
            REFUSED,
            f"the consumer lost its broker connection (Celery is reconnecting): {REFUSED}",
        ),
        (
            Connection.LOST,
            None,
            "the consumer lost its broker connection (Celery is reconnecting)",
        ),
        (Connection.STOPPING, None, "the consumer is shutting down"),
    ],
    ids=["ready", "connected-but-silent", "not-yet-refused", "not-yet", "lost-refused",
         "lost-but-answering", "stopping"],
)  # fmt: skip
def test_the_report_says_why_the_consumer_is_not_ready(
    connection: Connection, check_error: str | None, expected: str | None
) -> None:
    assert problem(connection, check_error) == expected


@pytest.mark.parametrize(
    ("report", "age", "expected"),
    [
        (Report(pid=41, problem=None), 3.0, None),
        (Report(pid=41, problem="the consumer is shutting down"), 3.0,
         "the consumer is shutting down"),
        (Report(pid=41, problem=None), 20.0, None),
        (Report(pid=41, problem=None), 21.0,
         "the consumer's last broker report is 21s old (it writes one every 5s): "
         "the consumer is stuck"),
        (Report(pid=40, problem=None), 1.0,
         "the consumer has not reported its broker connection yet"),
        (None, 0.0, "the consumer has not reported its broker connection yet"),
    ],
    ids=["fresh-ready", "fresh-unready", "at-the-bound", "stale",
         "a-previous-consumer-s", "none"],
)  # fmt: skip
def test_readiness_trusts_only_a_fresh_report_of_the_running_consumer(
    report: Report | None, age: float, expected: str | None
) -> None:
    assert verdict(report, age, consumer_pid=41) == expected


def test_a_written_report_reads_back_and_replaces_the_last(tmp_path: Path) -> None:
    write(tmp_path, Report(pid=7, problem="the consumer is not connected to the broker yet"))
    write(tmp_path, Report(pid=7, problem=None))
    report, written = read(tmp_path)
    assert report == Report(pid=7, problem=None)
    assert written == (tmp_path / REPORT_FILE).stat().st_mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == [REPORT_FILE]


@pytest.mark.parametrize(
    "content",
    ["", "{", '{"pid": "x", "problem": null}', '{"problem": null}', '{"pid": 1, "problem": 3}'],
    ids=["empty", "truncated", "bad-pid", "no-pid", "bad-problem"],
)
def test_an_unreadable_report_counts_as_none(tmp_path: Path, content: str) -> None:
    (tmp_path / REPORT_FILE).write_text(content)
    assert read(tmp_path) == (None, 0.0)


def test_no_report_counts_as_none(tmp_path: Path) -> None:
    assert read(tmp_path) == (None, 0.0)
