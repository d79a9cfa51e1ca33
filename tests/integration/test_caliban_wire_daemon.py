"""Every upstream caliban request, exactly as upstream's types serialize it, sent to a
real daemon: each gets one reply that parses in our client and has every field of
upstream's reply of that kind with the same JSON types (``tests/caliban_wire.py``). Each
request naming an agent is sent twice: with upstream's id (no such agent here:
``not_found``) and with a live agent's id (the verb's own reply)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.caliban_wire import reply_vector, shape_mismatches, vectors
from worker_agent import proto
from worker_agent.client import SupervisorClient
from worker_agent.proto import AgentStatus
from worker_agent.testing import DaemonProcess

LONG = "turns=100000,turn_ms=50"
ORDER = ("report_status_running", "report_status_idle", "attach", "kill", "respawn", "rm_force")


def answer(client: SupervisorClient, request: dict[str, Any]) -> dict[str, Any]:
    reply = client.call_raw(json.dumps(request).encode())
    proto.parse_reply(json.dumps(reply))  # our own client reads it
    kind = reply["kind"]
    match = {"error_kind": reply["error"]["kind"]} if kind == "error" else {}
    assert shape_mismatches(reply, reply_vector(kind, **match)) == [], (request, reply)
    return reply


def test_every_upstream_request_is_answered_in_upstreams_reply_shape(tmp_short: Path) -> None:
    requests = {e["name"]: e["json"] for e in vectors("requests.jsonl")}
    daemon = DaemonProcess(tmp_short).start()
    try:
        [live] = daemon.spawn(1, LONG)
        kinds: dict[str, str] = {}
        with daemon.client(timeout=30) as client:
            for name, request in requests.items():
                if name != "shutdown":
                    kinds[name] = answer(client, request)["kind"]
            for name in ORDER:
                reply = answer(client, {**requests[name], "id": live})
                kinds[f"{name}@live"] = reply["kind"]
                if name == "respawn":
                    daemon.wait_for_status([live], {AgentStatus.RUNNING, AgentStatus.IDLE}, 30)
            kinds["shutdown"] = answer(client, requests["shutdown"])["kind"]
        assert daemon.wait(60) == 0
    finally:
        daemon.stop()
    assert kinds["spawn_default"] == kinds["spawn_full"] == "spawned", kinds
    assert kinds["attach"] == kinds["kill"] == "error", kinds  # upstream's ids are not ours
    assert [kinds[f"{n}@live"] for n in ORDER] == [
        "status_reported", "status_reported", "attach_ack", "killed", "respawned", "removed",
    ], kinds  # fmt: skip
    assert kinds["shutdown"] == "shutdown_ack"
