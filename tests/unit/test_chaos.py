"""The chaos harness's own parts, without a stack: its arguments, its seeded choices, the
moves it plans and replays, and the turn accounting its oracle reads from real
transcripts and sessions (written by the reference worker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.settings import Settings
from orchestrator.testing import chaos
from orchestrator.testing.chaos import Model, Move, StackChoice, plan, replayable
from worker_agent import layout


def run_chaos(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.testing.chaos", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "said"),
    [
        pytest.param(["--seed", "x", "--sequences", "1", "--steps", "1"],
                     "argument --seed: 'x' is not a whole number", id="seed-not-a-number"),
        pytest.param(["--seed", "-1", "--sequences", "1", "--steps", "1"],
                     "argument --seed: -1 is below 0", id="negative-seed"),
        pytest.param(["--seed", "1", "--sequences", "0", "--steps", "1"],
                     "argument --sequences: 0 is below 1", id="no-sequence"),
        pytest.param(["--seed", "1", "--sequences", "1", "--steps", "2.5"],
                     "argument --steps: '2.5' is not a whole number", id="steps-not-whole"),
        pytest.param(["--seed", "1"], "the following arguments are required: --sequences, "
                     "--steps", id="missing"),
        pytest.param(["--seed", "1", "--sequences", "1", "--steps", "1", "--fast"],
                     "unrecognized arguments: --fast", id="unknown-option"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_in_one_line_with_exit_2(args: list[str], said: str) -> None:
    """Tried: each bad argument: refused before anything is started (it answers at once,
    having printed nothing else)."""
    done = run_chaos(*args)
    assert done.returncode == 2
    assert done.stderr == f"chaos: {said}\n"
    assert done.stdout == ""


def test_the_seed_picks_the_stack_and_every_choice_is_met_by_some_seed() -> None:
    choices = {seed: StackChoice.of_seed(seed) for seed in range(64)}
    assert choices[7] == StackChoice.of_seed(7)
    assert {c.snapshots for c in choices.values()} == {True, False}
    assert {c.broker for c in choices.values()} == {"embedded", "redis"}
    assert {c.ledger for c in choices.values()} == {"sqlite", "postgresql"}


def test_a_plan_is_the_same_for_the_same_seed_and_sequence_and_valid_at_each_step() -> None:
    """Tried: 200 steps of two sequences of one seed; each move is valid for the model as
    it stands (a task acted on exists, a created one does not, at most 5 at once), both
    kinds of move come up, and a plan replays whole."""
    first = plan(11, 0, 200)
    assert first == plan(11, 0, 200)
    assert first != plan(11, 1, 200)
    model = Model()
    for move in first:
        if move.kind in chaos.CREATES:
            assert move.task not in model.tasks and move.task not in model.deleted
            if move.kind == "restore":  # a deleted task that ran, restored once
                assert move.source in model.deleted and move.source in model.restorable
                assert move.namespace == model.restorable[move.source].namespace
        elif move.kind == "delete-namespace":
            assert move.namespace in model.namespaces and move.namespace != chaos.NAMESPACE
        elif move.task is not None:
            assert move.task in model.tasks, move
        model.apply(move)
        assert len(model.tasks) <= chaos.MAX_TASKS
    kinds = {m.kind for m in first}
    assert kinds & set(chaos.FAULTS) and kinds & set(chaos.USER_ACTIONS)
    assert replayable(first) == first


def test_every_move_comes_up_in_the_plans_of_a_few_seeds() -> None:
    """Tried: 10 seeds' first sequences of 60 steps: each user action and each fault is
    planned somewhere (a move the planner never picks would never be tried)."""
    kinds = {m.kind for seed in range(10) for m in plan(seed, 0, 60)}
    assert set(chaos.USER_ACTIONS) | set(chaos.FAULTS) <= kinds, (
        set(chaos.USER_ACTIONS) | set(chaos.FAULTS)
    ) - kinds


def test_a_namespace_deletion_deletes_its_tasks_and_their_checkpoints_restore_no_more() -> None:
    """Tried: t0 in ns0 deleted and restorable, t1 and t2 in ns0 live, t3 in default: the
    namespace's deletion deletes t1 and t2, leaves t3, and t0 can no longer be restored
    (its checkpoint's workspace went with the namespace)."""
    model = Model()
    for move in [Move("create", "t0", 1, "ns0"), Move("delete", "t0", namespace="ns0"),
                 Move("create", "t1", 1, "ns0"), Move("create-idle", "t2", 2, "ns0"),
                 Move("create", "t3", 1)]:  # fmt: skip
        model.apply(move)
    assert set(model.restorable) == {"t0"}
    model.apply(Move("delete-namespace", namespace="ns0"))
    assert set(model.tasks) == {"t3"} and model.deleted == ["t0", "t1", "t2"]
    assert model.restorable == {} and model.namespaces == []
    assert replayable([Move("delete-namespace", namespace="ns0")]) == []


def test_a_prune_keeping_0_ends_restores_and_an_idle_task_settles_suspended() -> None:
    model = Model()
    for move in [Move("create-idle", "t0", 2), Move("delete", "t0"), Move("create", "t1", 1)]:
        model.apply(move)
    model.apply(Move("restore", "t2", 2, source="t0"))
    assert model.tasks["t2"].idle and model.tasks["t2"].wants_suspended
    assert not model.tasks["t2"].suspended  # idle, not asked to suspend
    model.apply(Move("delete", "t1"))
    model.apply(Move("prune", value=1))
    assert set(model.restorable) == {"t1"}
    model.apply(Move("prune", value=0))
    assert model.restorable == {}
    # A restore whose source was never deleted (its delete dropped by a shrink) goes too.
    assert replayable([Move("create", "t0", 1), Move("restore", "t1", 1, source="t0")]) == [
        Move("create", "t0", 1)
    ]


def test_a_shortened_plan_drops_what_no_longer_makes_sense() -> None:
    """Tried: the create of a task dropped: every later move on it goes too."""
    moves = [Move("create", "t0", 1), Move("create", "t1", 2), Move("suspend", "t0"),
             Move("kill-worker"), Move("resume", "t0"), Move("delete", "t1")]  # fmt: skip
    assert replayable(moves[1:]) == [Move("create", "t1", 2), Move("kill-worker"),
                                     Move("delete", "t1")]  # fmt: skip


def test_the_settle_bound_comes_from_the_default_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """3 x 15 s heartbeats, the 30 s drain grace, a stop of up to 20 s, and a minute."""
    for variable in [v for v in os.environ if v.startswith("DRAIN_")]:
        monkeypatch.delenv(variable)
    assert chaos.settle_secs(Settings()) == 45 + 30 + 20 + 60


# ----------------------------------------------------------------- turn accounting


@pytest.fixture
def worked(tmp_path: Path) -> Path:
    """An agent's directory after the reference worker ran 4 turns and exited, in a
    workspace of its own (``volumes/<namespace>/<pvc>``, as the dev stack keeps them)."""
    agent = tmp_path / "volumes" / "default" / "ws" / "agents" / "agent-a"
    agent.mkdir(parents=True)
    with layout.transcript_file(agent).open("wb") as out:
        subprocess.run(
            [sys.executable, "-m", "worker_agent.worker", "--session-dir", str(agent),
             "--agent-id", "agent-a", "--provider", "scripted",
             "--model", "turns=4,turn_ms=1,then=exit"],
            stdout=out, timeout=60, check=True,
        )  # fmt: skip
    return agent


def test_a_worker_s_own_transcript_and_session_account_for_every_turn_once(worked: Path) -> None:
    count = chaos.transcript_turns(layout.transcript_file(worked))
    assert (count.lost, count.duplicated, count.problems) == (0, 0, [])
    assert chaos.session_turns(worked) == []
    # This test's volumes alone: not the other tests' directories beside its own.
    volumes = worked.parents[3]
    assert sorted(volumes.glob(f"*/*/{layout.AGENTS_DIR}/*")) == [worked]
    assert chaos.turns_on_disk(volumes).problems == []


def test_a_turn_announced_twice_is_a_duplicate(worked: Path) -> None:
    path = layout.transcript_file(worked)
    lines = path.read_text().splitlines()
    second = next(line for line in lines if json.loads(line).get("turn_index") == 1
                  and json.loads(line)["type"] == "TurnEnd")  # fmt: skip
    path.write_text("\n".join([*lines, second]) + "\n")
    count = chaos.transcript_turns(path)
    assert (count.lost, count.duplicated) == (0, 1)
    assert "turn 2 announced again after turn 4" in count.problems[0]


def test_a_resume_below_the_turns_announced_loses_those_between(worked: Path) -> None:
    """Tried: a resume marker continuing at turn 2 after turn 4 was announced: turns 2, 3
    and 4 are lost (the state it resumed did not hold them)."""
    path = layout.transcript_file(worked)
    marker = {"type": "AssistantTextDelta", "turn_index": 1, "content_block_index": 0,
              "text": "", "caliban_drain": {"resumed_from": 2}}  # fmt: skip
    with path.open("a") as out:
        out.write(json.dumps(marker) + "\n")
    count = chaos.transcript_turns(path)
    assert (count.lost, count.duplicated) == (3, 0)


def test_a_session_whose_prompts_skip_a_turn_is_reported(worked: Path) -> None:
    session = json.loads(layout.session_file(worked).read_text())
    users = [m for m in session["messages"] if m["role"] == "user"]
    users[2]["content"][0]["text"] = "scripted prompt 7"
    layout.session_file(worked).write_text(json.dumps(session))
    [problem] = chaos.session_turns(worked)
    assert "its prompts are turns 1, 2, 7, 4" in problem
