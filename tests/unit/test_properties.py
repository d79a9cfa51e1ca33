"""Property-based tests of the parsers that take input from outside: the control
protocol, the session loader, the CalibanTask spec and its durations. The property is
the same for each: whatever comes in, the answer is a value or the parser's own clear
error, never another exception (which would crash the daemon or the operator). And one
of the idle timing: no clock step moves the estimate by more than the bridge."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.operator.lifecycle import (
    IdleReport,
    SpecError,
    idle_secs,
    parse_duration,
    parse_spec,
)
from worker_agent import proto
from worker_agent.proto import ProtocolError
from worker_agent.session import SessionError, decode_session

PROPERTY = settings(max_examples=300, deadline=None, database=None)

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)
REQUEST_KINDS = [
    "list", "spawn", "attach", "kill", "respawn", "rm", "status", "shutdown",
    "report_status", "drain", "resume", "bogus",
]  # fmt: skip
REQUEST_FIELDS = [
    "spec", "id", "force", "status", "turns", "grace_secs", "session_dir", "token", "extra",
]  # fmt: skip


def decode_and_validate(line: bytes) -> proto.Request | None:
    refusal: ProtocolError | None = None
    try:
        return proto.validate_request(proto.decode_line(line))
    except ProtocolError as exc:
        refusal = exc
    assert refusal.message  # a refusal always says why
    return None


@PROPERTY
@given(st.binary(max_size=2000))
def test_any_bytes_are_a_request_or_a_protocol_error(line: bytes) -> None:
    decode_and_validate(line)


@PROPERTY
@given(
    st.sampled_from(REQUEST_KINDS),
    st.dictionaries(st.sampled_from(REQUEST_FIELDS), json_values, max_size=4),
)
def test_any_object_of_a_known_shape_is_a_request_or_a_protocol_error(
    kind: str, fields: dict[str, Any]
) -> None:
    request = decode_and_validate(json.dumps({"kind": kind, **fields}).encode())
    if request is not None:
        assert request.kind == kind


@PROPERTY
@given(st.integers(min_value=0, max_value=5000), st.sampled_from(["[", '{"a":']))
def test_nesting_of_any_depth_is_handled(depth: int, opener: str) -> None:
    decode_and_validate((opener * depth).encode() + b"\n")


@PROPERTY
@given(st.binary(max_size=2000) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_session_file_is_a_session_or_a_session_error(raw: bytes) -> None:
    try:
        session = decode_session(raw, source="session.json")
    except SessionError as exc:
        refusal = str(exc)
        assert "session.json" in refusal
        return
    assert session.turns >= 0 and isinstance(session.messages, list)


@PROPERTY
@given(json_values)
def test_any_duration_value_is_seconds_or_a_spec_error(value: Any) -> None:
    try:
        seconds = parse_duration(value, "lifecycle.idleTimeout")
    except SpecError as exc:
        refusal = str(exc)
        assert refusal.startswith("spec.lifecycle.idleTimeout:")
        return
    assert seconds >= 0


@PROPERTY
@given(
    st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=10_000), st.sampled_from(["ms", "s", "m", "h"])
        ),
        min_size=1,
        max_size=4,
    )
)
def test_a_well_formed_duration_is_the_sum_of_its_parts(parts: list[tuple[int, str]]) -> None:
    text = "".join(f"{n}{unit}" for n, unit in parts)
    unit_secs = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    expected = sum(n * unit_secs[unit] for n, unit in parts)
    assert abs(parse_duration(text, "d") - expected) < 1e-6


spec_sections = st.fixed_dictionaries(
    {},
    optional={
        "task": st.dictionaries(
            st.sampled_from(["agents", "provider", "model", "prompt", "image"]), json_values
        )
        | json_values,
        "lifecycle": st.dictionaries(
            st.sampled_from(
                ["idleTimeout", "onDelete", "drainGracePeriod", "drainTimeout", "suspend"]
            ),
            json_values | st.sampled_from(["30s", "2m", "checkpoint", "delete", "1h30m"]),
        )
        | json_values,
        "resumeFrom": st.dictionaries(st.just("checkpointRef"), json_values) | json_values,
        "sandbox": st.dictionaries(st.just("apiVersion"), json_values) | json_values,
        "workspace": st.dictionaries(st.just("storage"), json_values) | json_values,
    },
)


@settings(
    max_examples=500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(spec_sections)
def test_any_calibantask_spec_is_a_task_spec_or_a_spec_error(spec: dict[str, Any]) -> None:
    try:
        parsed = parse_spec(spec)
    except SpecError as exc:
        refusal = str(exc)
        assert refusal.startswith("spec.")
        return
    assert 1 <= parsed.agents <= 64
    assert parsed.drain_grace_secs >= 0 and parsed.drain_timeout_secs >= 0


# ------------------------------------------------------------------ idle timing, any clock

EPOCH = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
seconds = st.floats(min_value=0, max_value=10 * 86400, allow_nan=False)
steps = st.floats(min_value=-365 * 86400, max_value=365 * 86400, allow_nan=False)


@PROPERTY
@given(idle_for=seconds, bridge=st.floats(min_value=0, max_value=3600), jump=steps, before=steps)
def test_a_clock_step_of_any_size_moves_the_idle_estimate_by_at_most_one_bridge(
    idle_for: float, bridge: float, jump: float, before: float
) -> None:
    report = IdleReport(idle_for_secs=idle_for, received_at=EPOCH)
    now = EPOCH + timedelta(seconds=before)

    estimate = idle_secs(report, now, bridge)
    stepped = idle_secs(report, now + timedelta(seconds=jump), bridge)

    assert idle_for <= estimate <= idle_for + bridge
    assert abs(stepped - estimate) <= bridge + 1e-6  # float rounding of the sums
