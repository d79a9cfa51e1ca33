"""A task's key and signature: each task (namespace, name, uid) has its own key, a body
signed with it verifies only with it, and any change of a signed body, or of its key,
fails; a bad key is refused in one line."""

from __future__ import annotations

import pytest

from worker_agent import signing

MESSAGE_KEY = bytes(range(32))
BODY: dict[str, object] = {
    "op_id": "0b1c", "namespace": "team-a", "name": "task-1", "task_uid": "uid-a",
    "refs": [{"id": "agent-1", "turns": 3}], "error": None, "seconds": 1.25,
}  # fmt: skip


def key(namespace: str = "team-a", name: str = "task-1", uid: str = "uid-a") -> bytes:
    return signing.task_key(MESSAGE_KEY, namespace, name, uid)


def test_every_part_of_a_task_makes_another_key() -> None:
    keys = {key(), key(namespace="team-b"), key(name="task-2"), key(uid="uid-b")}
    assert len(keys) == 4
    assert key() != signing.task_key(bytes(32), "team-a", "task-1", "uid-a")
    # The parts are separated: a name cannot move into the namespace.
    assert key("team-a", "b-task") != key("team-a-b", "task")


def test_a_signed_body_verifies_with_its_key_and_no_other() -> None:
    signed = signing.sign(key(), BODY)
    assert signed == {**BODY, "signature": signed["signature"]}
    assert signing.signed_by(key(), signed)
    assert not signing.signed_by(key(uid="uid-b"), signed)
    # Key order does not matter: the signature is over the canonical JSON.
    assert signing.signed_by(key(), dict(reversed(list(signed.items()))))


@pytest.mark.parametrize(
    "change",
    [
        {"task_uid": "uid-b"}, {"namespace": "team-b"}, {"op_id": "0b1d"},
        {"refs": []}, {"error": "forged"}, {"seconds": 1.26}, {"extra": True},
    ],
    ids=["uid", "namespace", "op", "refs", "error", "number", "added-field"],
)  # fmt: skip
def test_any_change_of_a_signed_body_fails(change: dict[str, object]) -> None:
    assert not signing.signed_by(key(), {**signing.sign(key(), BODY), **change})


@pytest.mark.parametrize(
    "body",
    [BODY, {**BODY, "signature": None}, {**BODY, "signature": 7}, "text", None],
    ids=["unsigned", "null", "number", "not-an-object", "none"],
)
def test_what_is_not_signed_is_not_signed_by_anyone(body: object) -> None:
    assert not signing.signed_by(key(), body)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("zz" * 32, "DRAIN_MESSAGE_KEY is not hexadecimal"),
        ("ab" * 16, "DRAIN_MESSAGE_KEY has 16 bytes; at least 32 are needed"),
    ],
    ids=["not-hex", "short"],
)
def test_a_bad_key_is_refused_in_one_line(text: str, message: str) -> None:
    with pytest.raises(signing.BadKey) as refused:
        signing.parse_key(text, "DRAIN_MESSAGE_KEY")
    assert str(refused.value) == message
    assert signing.parse_key(" " + "ab" * 32 + "\n", "DRAIN_MESSAGE_KEY") == bytes([0xAB]) * 32
