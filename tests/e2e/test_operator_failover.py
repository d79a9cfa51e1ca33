"""Operator failover end to end: two replicas with kopf peering, the active one killed in
the middle of a deletion's drain, the standby finishing the deletion.

``drainctl dev up --no-operator`` runs the embedded API (serving kopf's peering CRDs),
the embedded broker, a SQLite ledger, the orchestrator worker and the stand-in Sandbox
controller; the test applies ``deploy/base/kopf-peering.yaml`` (the CRDs and the
ClusterKopfPeering ``caliban-drain``) and starts two ``drainctl operator --manage-sandbox
--peering caliban-drain`` processes, with the project's default peering settings. The
replica the peering object ranks highest is the active one; it is SIGKILLed (a node
lost) once the deletion's drain is in the ledger and before it finishes. The standby
must take over and complete the deletion with exactly one checkpoint, not a forced one,
holding every turn every agent completed. The turn lengths are a task spec's own: the
agents finish the turn they are in before they drain, so a long turn keeps the drain on
its way past the takeover.
"""

from __future__ import annotations

import re
import signal
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from orchestrator.devcluster.broker import free_port
from orchestrator.devcluster.up import MESSAGE_KEY_FILE
from orchestrator.ledger import OperationKind
from orchestrator.operator.lifecycle import Purpose, operation_key
from orchestrator.testing import OperatorProcess
from tests.e2e.support import DevStack, task_manifest
from tests.e2e.test_disruptions import assert_every_turn_announced_once
from tests.support import wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PEERING_MANIFEST = REPO / "deploy" / "base" / "kopf-peering.yaml"
PEERING = "caliban-drain"
AGENTS = 2
RESUMED = "Resuming operations after the pause"
"""What kopf logs when a paused replica becomes the active one."""
_BROKER = re.compile(r"broker (redis://\S+)$", re.MULTILINE)
_TS = re.compile(r"^ts=(\S+ \S+) ")


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    root = Path(tempfile.mkdtemp(prefix="cd-failover-", dir="/tmp"))
    dev = DevStack(root, None, f"sqlite:///{root / 'ledger.db'}", "--no-operator")
    try:
        assert dev.kubectl("apply", "-f", str(PEERING_MANIFEST)).returncode == 0
        yield dev
        assert dev.ledger_contradictions() == []
    finally:
        dev.close()


def operator_env(stack: DevStack) -> dict[str, str]:
    """The stack's environment, as its own operator would have it: its kubeconfig, its
    ledger, the embedded broker it printed and its message key."""
    found = wait_until(lambda: _BROKER.search(stack.log_text()), 30, "the stack's broker URL")
    broker = found.group(1)
    # The stack's message key, which its worker checks daemons' messages with.
    key = stack.state / MESSAGE_KEY_FILE
    wait_until(key.exists, 30, "the stack's message key")
    return {**stack.env, "KUBECONFIG": str(stack.kubeconfig), "DRAIN_BROKER_URL": broker,
            "DRAIN_RESULT_BACKEND": broker,
            "DRAIN_MESSAGE_KEY": key.read_text().strip()}  # fmt: skip


@pytest.fixture
def replicas(stack: DevStack, tmp_path: Path) -> Iterator[list[OperatorProcess]]:
    """Two operator replicas sharing the peering object, started one after the other."""
    env = operator_env(stack)
    started = []
    try:
        for identity in ("operator-a", "operator-b"):
            replica = OperatorProcess(tmp_path / f"{identity}.log", env,
                                      liveness_port=free_port(), peering=PEERING,
                                      identity=identity)  # fmt: skip
            started.append(replica)
            replica.start()
        yield started
    finally:
        for replica in started:
            replica.stop(30)


def peers(stack: DevStack) -> dict[str, dict[str, object]]:
    """The peering object's status: identity → its keep-alive (priority, lifetime, lastseen)."""
    found = stack.api_get(f"/apis/kopf.dev/v1/clusterkopfpeerings/{PEERING}")
    assert found is not None, f"no ClusterKopfPeering {PEERING}"
    status = found.get("status") or {}
    assert isinstance(status, dict)
    return status


def active_and_standby(
    stack: DevStack, replicas: list[OperatorProcess]
) -> tuple[OperatorProcess, OperatorProcess]:
    """The replica the peering object ranks highest (it acts) and the other, once both
    keep-alives are in; the active one's log says it resumed, the standby's does not."""
    wanted = {r.identity for r in replicas}
    wait_until(lambda: wanted <= set(peers(stack)), 60, f"keep-alives of {wanted}")
    status = peers(stack)

    def priority(replica: OperatorProcess) -> int:
        keepalive = status[str(replica.identity)]
        assert isinstance(keepalive, dict)
        return int(str(keepalive["priority"]))

    first, second = sorted(replicas, key=priority, reverse=True)
    wait_until(lambda: RESUMED in first.log_text(), 60, f"{first.identity} to become active")
    assert RESUMED not in second.log_text()
    return first, second


def first_logged(replica: OperatorProcess, text: str) -> datetime:
    """When ``replica`` first logged a line with ``text`` (its own clock, local time)."""
    for line in replica.log_text().splitlines():
        if text in line and (stamp := _TS.match(line)):
            return datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f")
    raise AssertionError(f"{replica.identity} never logged {text!r}")


def test_both_replicas_answer_their_liveness_probe(
    stack: DevStack, replicas: list[OperatorProcess]
) -> None:
    active, standby = active_and_standby(stack, replicas)
    assert active.liveness_status() == 200
    assert standby.liveness_status() == 200


@pytest.mark.parametrize(
    "turn_ms",
    [5000, 20000],
    ids=["drain-ends-before-the-takeover", "drain-still-running-at-the-takeover"],
)
def test_the_standby_finishes_a_deletion_whose_drain_the_killed_replica_began(
    stack: DevStack, replicas: list[OperatorProcess], turn_ms: int
) -> None:
    name = f"failover-{turn_ms}"
    active, standby = active_and_standby(stack, replicas)
    model = f"turns=100000,turn_ms={turn_ms}"
    assert stack.apply(task_manifest(name, agents=AGENTS, model=model)).returncode == 0
    stack.wait_phase("default", name, "Running")
    pvc = stack.pvc_of(name)
    stack.wait_turns(pvc, AGENTS, at_least=1)
    uid = str(stack.task("default", name)["metadata"]["uid"])  # type: ignore[index]

    stack.kubectl("delete", "ctask", name, "--wait=false")
    key = operation_key(uid, Purpose.DELETE)
    drain = wait_until(lambda: stack.ledger.find_operation(key), 60, "the deletion's drain")
    active.signal(signal.SIGKILL)
    killed_at = datetime.fromtimestamp(time.time())
    active.wait(30)
    in_flight = stack.ledger.get_operation(drain.id)
    assert in_flight is not None
    assert not in_flight.terminal, f"the drain finished before the kill: {in_flight.state}"

    wait_until(lambda: stack.task("default", name) is None, 180, f"{name} to be gone")
    resumed = first_logged(standby, RESUMED)
    released = first_logged(standby, "Handler 'drain_on_delete' succeeded")
    print(f"\n{name}: takeover {(resumed - killed_at).total_seconds():.2f} s after the kill, "
          f"released {(released - killed_at).total_seconds():.2f} s after it")  # fmt: skip

    checkpoints = [c for c in stack.ledger.list_checkpoints(namespace="default", name=name)
                   if c.task_uid == uid]  # fmt: skip
    assert len(checkpoints) == 1
    [checkpoint] = checkpoints
    assert not checkpoint.forced
    assert checkpoint.operation_id == drain.id
    kinds = [op.kind for op in stack.ledger.list_operations(limit=1000) if op.task_uid == uid]
    assert OperationKind.FORCE_DELETE not in kinds
    assert {a.agent_id: a.turns for a in checkpoint.agents} == stack.turns_on_disk(pvc)
    assert len(checkpoint.agents) == AGENTS
    assert_every_turn_announced_once(stack, pvc)
