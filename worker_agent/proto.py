"""Wire types of the supervisor's NDJSON control protocol, and nothing else.

One request object per line, one reply per request, tagged by ``"kind"`` in snake_case.
The messages are upstream caliban's (``caliban-supervisor``'s ``CtlRequest``,
``CtlReply``, ``SupervisorError``, ``AgentRecord``, ``DaemonStatus``, ``SpawnSpec`` and the
transport's ``Endpoint``) exactly as serde writes them, proved against vectors produced
by upstream's own types (``tests/fixtures/caliban-wire``). Unknown fields are ignored, as
serde does, so a caliban client's requests and a caliband's replies parse here and ours
parse there. ``drain``, ``retire`` and ``resume``, the ``drained``/``retired``/``resumed``
replies and the ``draining``/``drained`` statuses are this project's additions, shaped as
proposed for upstream (#650/#651): a serde ``Duration`` grace, resume through
``SpawnSpec.resume_session`` or ``resume``. Fields of ours that upstream does not have
(``turns``, ``created_at``, ``message`` on every error…) ride along as extras upstream
ignores. ``registry`` holds live state, ``store`` the on-disk layout, ``server`` the
accept loop.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from worker_agent.layout import AGENT_SOCKET_FILE

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
    """Why a request was refused. Only ``WIRE_ERROR_KINDS`` go on the wire (upstream's
    ``SupervisorError`` has no others): a malformed request is answered ``internal``
    with ``"bad request: …"``, as caliband answers it."""

    NOT_FOUND = "not_found"
    INVALID_STATE = "invalid_state"
    BAD_REQUEST = "bad_request"
    INTERNAL = "internal"


WIRE_ERROR_KINDS: Final = ("not_found", "invalid_state", "internal")

DAEMON_STOPPING: Final = "the daemon is stopping"
"""How an error message ends when the daemon refuses a spawn or resume because it is
shutting down (its pod is going). Nothing is wrong with the request: another daemon on
the same store (the next pod) will serve it, so the consumer hands it back to the queue
instead of answering (``worker_agent.consumer``)."""


def says_daemon_stopping(kind: str, message: str) -> bool:
    """Whether an error reply is a stopping daemon's refusal (``DAEMON_STOPPING``). Such
    a refusal names no agent, so it travels as ``internal``; ``invalid_state`` is read
    the same way for daemons of earlier releases."""
    return kind in (ErrorKind.INTERNAL, ErrorKind.INVALID_STATE) and message.endswith(
        DAEMON_STOPPING
    )


class _Wire(BaseModel):
    """A message of the protocol: typed strictly, unknown fields ignored (as serde)."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


# --------------------------------------------------------------------------- values


class UnixEndpoint(_Wire):
    scheme: Literal["unix"] = "unix"
    path: str

    def __str__(self) -> str:
        return f"unix:{self.path}"


class TcpEndpoint(_Wire):
    scheme: Literal["tcp"] = "tcp"
    addr: str

    def __str__(self) -> str:
        return f"tcp:{self.addr}"


Endpoint = Annotated[UnixEndpoint | TcpEndpoint, Field(discriminator="scheme")]
"""Where to connect: upstream's ``Endpoint``, ``{"scheme": "unix", "path": …}`` or
``{"scheme": "tcp", "addr": "host:port"}``. ``str()`` gives ``unix:PATH`` for logs."""


class Duration(_Wire):
    """A serde ``std::time::Duration``: ``{"secs": 5, "nanos": 0}``."""

    secs: int = Field(ge=0, le=int(MAX_GRACE_SECS))
    nanos: int = Field(default=0, ge=0, lt=1_000_000_000)

    @model_validator(mode="after")
    def _at_most_the_maximum(self) -> Duration:
        if self.seconds > MAX_GRACE_SECS:
            raise ValueError(f"at most {MAX_GRACE_SECS:.0f} seconds")
        return self

    @property
    def seconds(self) -> float:
        return self.secs + self.nanos / 1e9

    @classmethod
    def of(cls, seconds: float) -> Duration:
        whole = int(seconds)
        return cls(secs=whole, nanos=round((seconds - whole) * 1e9) % 1_000_000_000)


DEFAULT_GRACE: Final = Duration(secs=30)


def rfc3339(unix: float) -> str:
    """``2026-12-06T17:32:58.123456+00:00``, as upstream writes ``started_at``."""
    return datetime.fromtimestamp(unix, UTC).isoformat()


def unix_seconds(stamp: str) -> float | None:
    """The Unix time of an RFC 3339 ``started_at`` (nanoseconds cut to micro), or None."""
    text = re.sub(r"(\.\d{6})\d+", r"\1", stamp.strip()).replace("Z", "+00:00")
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


class SpawnSpec(BaseModel):
    """How to start an agent: upstream's ``SpawnSpec``, field for field, plus ours.

    ``provider`` and ``model`` left null take the worker's defaults, as upstream's do.
    Ours: ``cwd``, ``env``, ``resume_session`` (a session dir, absolute or relative to
    the store, whose conversation to continue: the resume-on-spawn shape proposed for
    upstream). Unknown fields are ignored for forward compatibility."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    label: str | None = None
    frontmatter_path: str | None = None
    initial_prompt: str = ""
    """Required upstream; an empty prompt here means the provider's own first turn."""
    model: str | None = None
    provider: str | None = None
    tool_allowlist: list[str] | None = None
    isolation_worktree: bool = False
    inherit_hooks: bool = True
    interactive: bool = False
    inherited_hooks_config: str | None = None
    source: str | None = None
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    resume_session: str | None = None


class AgentRecord(_Wire):
    """What the daemon knows of one agent: upstream's ``AgentRecord`` (``id``, ``name``,
    ``status``, ``started_at``, ``session_dir``, ``endpoint``, ``working_dir``, ``spec``)
    plus our bookkeeping; persisted as ``manifest.json``, which upstream's worker reads.

    A record of an earlier release (no ``name``, ``started_at``, ``endpoint``) gets them
    derived as it loads; a caliband's record (no ``created_at``) gets ours from
    ``started_at``. Pids are deliberately not part of the record, so a restarted daemon
    never signals a stale pid: a formerly live agent comes back ``crashed`` and is
    resumed, not adopted.
    """

    id: str
    name: str
    status: AgentStatus = Field(strict=False)
    started_at: str
    session_dir: str
    endpoint: Endpoint
    working_dir: str = ""
    spec: SpawnSpec
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

    @model_validator(mode="before")
    @classmethod
    def _complete(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        doc = dict(data)
        given = doc.get("spec")
        spec: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
        if "name" not in doc and isinstance(doc.get("id"), str):
            doc["name"] = spec.get("label") or f"agent-{doc['id']}"
        created = doc.get("created_at")
        if "started_at" not in doc and isinstance(created, int | float):
            doc["started_at"] = rfc3339(created)
        if created is None and isinstance(doc.get("started_at"), str):
            doc["created_at"] = unix_seconds(doc["started_at"]) or 0.0
        if "updated_at" not in doc and "created_at" in doc:
            doc["updated_at"] = doc["created_at"]
        directory = doc.get("session_dir")
        if "endpoint" not in doc and isinstance(directory, str):
            doc["endpoint"] = {"scheme": "unix", "path": f"{directory}/{AGENT_SOCKET_FILE}"}
        if "working_dir" not in doc and isinstance(directory, str) and created is not None:
            doc["working_dir"] = spec.get("cwd") or directory  # where ours always ran
        return doc


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
    """A request to the supervisor: one line, its kind naming it."""


class _Graceful(_Request):
    grace: Duration = DEFAULT_GRACE
    """How long workers get to flush and exit after SIGTERM; stragglers are SIGKILLed."""

    @model_validator(mode="before")
    @classmethod
    def _no_grace_secs(cls, data: Any) -> Any:
        # Ignoring an old caller's grace would silently give its agents 30 s instead.
        if isinstance(data, Mapping) and "grace_secs" in data:
            raise ValueError('grace_secs is replaced by grace: {"secs": N, "nanos": 0}')
        return data


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
    """A worker's report. Upstream's worker reports every status it has; this daemon
    acts on ``running`` and ``idle`` and acknowledges the rest (the worker's exit is
    what it records)."""

    kind: Literal["report_status"]
    id: str
    status: AgentStatus = Field(strict=False)  # its value, from a dict as from JSON
    turns: int | None = Field(default=None, ge=0)


class DrainRequest(_Graceful):
    kind: Literal["drain"]


class RetireRequest(_Graceful):
    """Scale down to ``keep`` agents: the task's agents beyond its ``keep`` oldest are
    drained as ``drain`` drains (SIGTERM, ``grace``, SIGKILL only for stragglers) and
    marked ``retired``. Answers one ``ResumeRef`` per agent it retired; none when the
    task has ``keep`` agents or fewer."""

    kind: Literal["retire"]
    keep: int = Field(ge=0)


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
UPSTREAM_REQUEST_KINDS: Final = (
    "list", "spawn", "attach", "kill", "respawn", "rm", "status", "shutdown", "report_status",
)  # fmt: skip
REQUEST_KINDS: Final = (*UPSTREAM_REQUEST_KINDS, "drain", "retire", "resume")
_request_adapter: TypeAdapter[Request] = TypeAdapter(Request)

# ---------------------------------------------------------------------------- replies


class Listed(_Wire):
    kind: Literal["listed"] = "listed"
    agents: list[AgentRecord]


class Spawned(_Wire):
    kind: Literal["spawned"] = "spawned"
    id: str
    endpoint: Endpoint


class AttachAck(_Wire):
    kind: Literal["attach_ack"] = "attach_ack"
    endpoint: Endpoint


class Killed(_Wire):
    """Upstream's is a bare ``{"kind": "killed"}``; ``id`` and ``exit`` are ours."""

    kind: Literal["killed"] = "killed"
    id: str | None = None
    exit: int | None = None


class Respawned(_Wire):
    kind: Literal["respawned"] = "respawned"
    id: str


class Removed(_Wire):
    """Upstream's is a bare ``{"kind": "removed"}``; ``id`` is ours."""

    kind: Literal["removed"] = "removed"
    id: str | None = None


class StatusReply(_Wire):
    """Upstream's ``Status(DaemonStatus)``: the daemon status inline beside ``kind``."""

    kind: Literal["status"] = "status"
    pid: int
    agents: int
    uptime_secs: int
    endpoint: Endpoint


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
    endpoint: Endpoint


class ErrorBody(_Wire):
    """Upstream's ``SupervisorError``: ``not_found {id}``, ``invalid_state {op, id,
    status}``, ``internal {message}``. We add ``message`` to every kind; one from a
    caliband without it gets the text upstream's ``Display`` gives."""

    kind: Literal["not_found", "invalid_state", "internal"]
    message: str
    id: str | None = None
    op: str | None = None
    status: AgentStatus | None = Field(default=None, strict=False)

    @model_validator(mode="before")
    @classmethod
    def _message(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or "message" in data:
            return data
        doc = dict(data)
        if doc.get("kind") == "not_found":
            doc["message"] = f"agent not found: {doc.get('id')}"
        elif doc.get("kind") == "invalid_state":
            status = str(doc.get("status", "")).replace("_", " ").title().replace(" ", "")
            doc["message"] = f"invalid state for {doc.get('op')}: agent {doc.get('id')} is {status}"
        return doc


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
    """A request the daemon refuses; becomes an ``error`` reply and nothing else.

    ``invalid_state`` goes on the wire only with the agent, the verb (``op``) and the
    agent's ``status``, which upstream requires; without them (a daemon-wide refusal:
    stopping, draining, full) it is ``internal`` with the same message. ``bad_request``
    is ``internal`` with ``"bad request: …"``, as caliband answers a malformed line."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        agent_id: str | None = None,
        *,
        op: str | None = None,
        status: AgentStatus | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.agent_id = agent_id
        self.op = op
        self.status = status

    def reply(self) -> ErrorReply:
        kind: Literal["not_found", "invalid_state", "internal"]
        message = self.message
        match self.kind:
            case ErrorKind.NOT_FOUND if self.agent_id is not None:
                kind = "not_found"
            case ErrorKind.INVALID_STATE if None not in (self.agent_id, self.op, self.status):
                kind = "invalid_state"
            case ErrorKind.BAD_REQUEST:
                kind, message = "internal", f"bad request: {message}"
            case _:
                kind = "internal"
        body = ErrorBody(
            kind=kind, message=message, id=self.agent_id, op=self.op, status=self.status
        )
        return ErrorReply(error=body)


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
