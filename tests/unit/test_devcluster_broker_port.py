"""The dev stack's embedded broker port across restarts (``broker.kept_port``): the one
it had when free again, a new one (kept for the next start) when another process holds
it. Real sockets on 127.0.0.1."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from orchestrator.devcluster import broker


def test_a_restart_gets_the_port_the_stack_had(tmp_path: Path) -> None:
    first = broker.kept_port(tmp_path)
    assert (tmp_path / broker.PORT_FILE).read_text().strip() == str(first)
    assert broker.kept_port(tmp_path) == first


def test_a_port_another_process_holds_is_given_up_for_a_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tried: the kept port listened on by another socket for longer than the wait for a
    dying broker (shortened here: what is shown is the choice, not the wait)."""
    monkeypatch.setattr(broker, "PORT_FREED_WITHIN_SECS", 0.3)
    first = broker.kept_port(tmp_path)
    with socket.socket() as holder:
        holder.bind((broker.HOST, first))
        holder.listen()
        second = broker.kept_port(tmp_path)
    assert second != first
    assert (tmp_path / broker.PORT_FILE).read_text().strip() == str(second)


def test_an_unreadable_port_file_is_replaced(tmp_path: Path) -> None:
    """Tried: a port file holding no number."""
    (tmp_path / broker.PORT_FILE).write_text("not a port\n")
    port = broker.kept_port(tmp_path)
    assert 0 < port < 65536
    assert (tmp_path / broker.PORT_FILE).read_text().strip() == str(port)
