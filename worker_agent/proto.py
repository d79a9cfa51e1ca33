"""Wire types of the supervisor's NDJSON control protocol, and nothing else.

One request object per line, one reply per request, tagged by ``"kind"`` in snake_case.
The verbs and field names are those of caliban's supervisor protocol, so a caliban
client speaks to this daemon; ``drain`` and ``resume`` are this project's additions.
``registry`` holds live state, ``store`` the on-disk layout, ``server`` the accept loop.

Requests are strict (a mistyped or unknown field is an error naming it); the spawn spec
ignores fields it does not know, so a richer caliban ``SpawnSpec`` still spawns.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

MAX_LINE_BYTES = 1024 * 1024
"""The longest request line the daemon reads; a longer one is refused and skipped."""

MAX_GRACE_SECS = 3600.0

MAX_NESTING = 64
"""The deepest nesting of arrays and objects a request may have. Our messages nest a few
levels; without a limit, 400 KB of ``[`` exhausts the parser's recursion."""

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(rb"[\[\]{}]")


class AgentStatus(StrEnum):
    SPAWNING = "spawning"
    RUNNING = "running"
    IDLE = "idle"
    DRAINING = "draining"
    DRAINED = "drained"
    KILLED = "killed"
    DONE = "done"
    FAILED = "failed"
    CRASHED = "crashed"

    @property
    def live(self) -> bool:
        """A live agent has (or is about to have) a worker process."""
        return self in _LIVE

    @property
    def interrupted(self) -> bool:
        """Stopped by something other than its own work or a user: drained (the
        daemon's own SIGTERM, an eviction, or a drain), crashed (its daemon died), or
        failed (its worker exited non-zero by itself: a crash, an OOM kill). Such an
        agent has work left and is resumed after a disruption; ``done`` (finished) and
        ``killed`` (stopped on purpose) are not."""
        return self in _INTERRUPTED


_LIVE = frozenset(
    {AgentStatus.SPAWNING, AgentStatus.RUNNING, AgentStatus.IDLE, AgentStatus.DRAINING}
)
_INTERRUPTED = frozenset({AgentStatus.DRAINED, AgentStatus.CRASHED, AgentStatus.FAILED})


class ErrorKind(StrEnum):
    NOT_FOUND = "not_found"
    INVALID_STATE = "invalid_state"
    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    INTERNAL = "internal"


DAEMON_STOPPING: Final = "the daemon is stopping"
"""How an ``invalid_state`` error ends when the daemon refuses a spawn or resume because
it is shutting down (its pod is going). Nothing is wrong with the request: another
daemon on the same store (the next pod) will serve it, so the consumer hands it back to
the queue instead of answering (``worker_agent.consumer``)."""


def says_daemon_stopping(kind: str, message: str) -> bool:
    """Whether an error reply is a stopping daemon's refusal (``DAEMON_STOPPING``)."""
    return kind == ErrorKind.INVALID_STATE and message.endswith(DAEMON_STOPPING)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class SpawnSpec(BaseModel):
    """How to start an agent. Unknown fields are ignored for forward compatibility."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    name: str | None = None
    initial_prompt: str | None = None
    provider: str = "scripted"
    model: str | None = None
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    resume_session: str | None = None
    """A session dir (absolute, or relative to the store) whose conversation to continue."""


class AgentRecord(_Wire):
    """What the daemon knows of one agent; persisted as ``manifest.json``.

    Pids are deliberately not part of the record, so a restarted daemon never signals a
    stale pid: a formerly live agent comes back ``crashed`` and is resumed, not adopted.
    """

    id: str
    status: AgentStatus
    spec: SpawnSpec
    session_dir: str
    created_at: float
    updated_at: float
    turns: int = 0
    exit: int | None = None
    idle_since: float | None = None
    error: str | None = None
    retired: bool = False
    """Removed from the task by a scale-down (``retire``): drained, its conversation kept
    on disk and in a checkpoint, but no longer one of the task's agents. A drain, a
    recovery and the heartbeat's counts leave it out; a ``resume`` brings it back."""


class ResumeRef(_Wire):
    """One agent's checkpoint: where its conversation is and what it holds."""

    id: str
    session_dir: str
    turns: int
    session_sha256: str | None
    clean: bool
    exit: int | None
    error: str | None = None


# --------------------------------------------------------------------------- requests


class _Request(_Wire):
    token: str | None = None
    """Bearer token; required on the network transport, ignored on the Unix socket."""


class ListRequest(_Request):
    kind: Literal["list"]


class SpawnRequest(_Request):
    kind: Literal["spawn"]
    spec: SpawnSpec


class AttachRequest(_Request):
    kind: Literal["attach"]
    id: str


class KillRequest(_Request):
    kind: Literal["kill"]
    id: str


class RespawnRequest(_Request):
    kind: Literal["respawn"]
    id: str


class RmRequest(_Request):
    kind: Literal["rm"]
    id: str
    force: bool = False


class StatusRequest(_Request):
    kind: Literal["status"]


class ShutdownRequest(_Request):
    kind: Literal["shutdown"]


class ReportStatusRequest(_Request):
    kind: Literal["report_status"]
    id: str
    status: Literal["running", "idle"]
    turns: int | None = Field(default=None, ge=0)


class DrainRequest(_Request):
    kind: Literal["drain"]
    grace_secs: float = Field(default=30.0, ge=0.0, le=MAX_GRACE_SECS, allow_inf_nan=False)


class RetireRequest(_Request):
    """Scale down to ``keep`` agents: the task's agents beyond its ``keep`` oldest are
    drained as ``drain`` drains (SIGTERM, ``grace_secs``, SIGKILL only for stragglers)
    and marked ``retired``. Answers one ``ResumeRef`` per agent it retired; none when
    the task has ``keep`` agents or fewer."""

    kind: Literal["retire"]
    keep: int = Field(ge=0)
    grace_secs: float = Field(default=30.0, ge=0.0, le=MAX_GRACE_SECS, allow_inf_nan=False)


class ResumeRequest(_Request):
    kind: Literal["resume"]
    session_dir: str = Field(min_length=1)
    expect_turns: int | None = Field(default=None, ge=0)
    """When resuming a checkpoint: the turns it recorded. A session on disk that differs
    (the workspace moved on since) is refused rather than resumed as something else."""
    expect_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """When resuming a checkpoint: the sha256 of the session.json it recorded."""
    provider: str | None = Field(default=None, min_length=1)
    """Continue the conversation with this provider instead of the one the agent was
    spawned with (a restore into a task whose spec names another); kept from then on."""
    model: str | None = None
    """Likewise for the model."""


Request = Annotated[
    ListRequest
    | SpawnRequest
    | AttachRequest
    | KillRequest
    | RespawnRequest
    | RmRequest
    | StatusRequest
    | ShutdownRequest
    | ReportStatusRequest
    | DrainRequest
    | RetireRequest
    | ResumeRequest,
    Field(discriminator="kind"),
]
REQUEST_KINDS = (
    "list", "spawn", "attach", "kill", "respawn", "rm", "status", "shutdown",
    "report_status", "drain", "retire", "resume",
)  # fmt: skip
_request_adapter: TypeAdapter[Request] = TypeAdapter(Request)

# ---------------------------------------------------------------------------- replies


class Listed(_Wire):
    kind: Literal["listed"] = "listed"
    agents: list[AgentRecord]


class Spawned(_Wire):
    kind: Literal["spawned"] = "spawned"
    id: str
    endpoint: str


class AttachAck(_Wire):
    kind: Literal["attach_ack"] = "attach_ack"
    endpoint: str


class Killed(_Wire):
    kind: Literal["killed"] = "killed"
    id: str
    exit: int | None = None


class Respawned(_Wire):
    kind: Literal["respawned"] = "respawned"
    id: str


class Removed(_Wire):
    kind: Literal["removed"] = "removed"
    id: str


class StatusReply(_Wire):
    kind: Literal["status"] = "status"
    pid: int
    agents: int
    uptime_secs: float
    endpoint: str


class ShutdownAck(_Wire):
    kind: Literal["shutdown_ack"] = "shutdown_ack"


class StatusReported(_Wire):
    kind: Literal["status_reported"] = "status_reported"


class Drained(_Wire):
    kind: Literal["drained"] = "drained"
    agents: list[ResumeRef]


class Retired(_Wire):
    kind: Literal["retired"] = "retired"
    agents: list[ResumeRef]


class Resumed(_Wire):
    kind: Literal["resumed"] = "resumed"
    id: str
    endpoint: str


class ErrorBody(_Wire):
    kind: ErrorKind
    message: str
    id: str | None = None


class ErrorReply(_Wire):
    kind: Literal["error"] = "error"
    error: ErrorBody


Reply = Annotated[
    Listed
    | Spawned
    | AttachAck
    | Killed
    | Respawned
    | Removed
    | StatusReply
    | ShutdownAck
    | StatusReported
    | Drained
    | Retired
    | Resumed
    | ErrorReply,
    Field(discriminator="kind"),
]
_reply_adapter: TypeAdapter[Reply] = TypeAdapter(Reply)


class ProtocolError(Exception):
    """A request the daemon refuses; becomes an ``error`` reply and nothing else."""

    def __init__(self, kind: ErrorKind, message: str, agent_id: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.agent_id = agent_id

    def reply(self) -> ErrorReply:
        return ErrorReply(error=ErrorBody(kind=self.kind, message=self.message, id=self.agent_id))


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        # loc[0] is the discriminator tag (the request kind); the rest is the field path.
        loc = ".".join(str(p) for p in err["loc"][1:]) or "request"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def decode_line(line: bytes | str) -> dict[str, Any]:
    """The JSON object on one line, or ``ProtocolError(bad_request)`` saying why not."""
    raw = line.encode() if isinstance(line, str) else line
    depth = deepest = 0
    for bracket in _JSON_BRACKET.finditer(_JSON_STRING.sub(b'""', raw)):
        depth += 1 if bracket.group() in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    if deepest > MAX_NESTING:
        raise ProtocolError(
            ErrorKind.BAD_REQUEST,
            f"request nests arrays and objects {deepest} deep; at most {MAX_NESTING}",
        )
    try:
        obj: Any = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(ErrorKind.BAD_REQUEST, f"request is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(
            ErrorKind.BAD_REQUEST,
            f"request must be a JSON object, got {type(obj).__name__}",
        )
    return obj


def validate_request(obj: dict[str, Any]) -> Request:
    """A typed request, or ``ProtocolError(bad_request)`` naming each faulty field."""
    kind = obj.get("kind")
    if not isinstance(kind, str):
        raise ProtocolError(ErrorKind.BAD_REQUEST, "request has no string field 'kind'")
    if kind not in REQUEST_KINDS:
        raise ProtocolError(
            ErrorKind.BAD_REQUEST,
            f"unknown request kind {kind!r}; expected one of {', '.join(REQUEST_KINDS)}",
        )
    try:
        return _request_adapter.validate_python(obj)
    except ValidationError as exc:
        raise ProtocolError(
            ErrorKind.BAD_REQUEST, f"bad {kind} request: {_describe(exc)}"
        ) from None


def parse_request(line: bytes | str) -> Request:
    return validate_request(decode_line(line))


def encode(message: BaseModel) -> bytes:
    """One NDJSON line."""
    return message.model_dump_json().encode() + b"\n"


def parse_reply(line: bytes | str) -> Reply:
    return _reply_adapter.validate_json(line)
