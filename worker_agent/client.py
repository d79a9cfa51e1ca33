"""A blocking client of the control protocol, for ``drainctl agents`` and the Celery tasks.

It speaks raw lines (``call_raw``) for tests of malformed input, and typed requests
(``call``) for everything else, over the Unix socket or over TCP with TLS, where it
authenticates as upstream's ``transport.rs`` does: one ``{"bearer": TOKEN}`` line right
after the handshake, then the protocol. It parses upstream caliband's replies as well as
ours, so the same client drives either.
"""

from __future__ import annotations

import json
import socket
import ssl
from pathlib import Path
from typing import Any, Self

from worker_agent import proto
from worker_agent.unixpath import connect


class ControlError(Exception):
    """The daemon answered with an ``error`` reply."""

    def __init__(self, body: proto.ErrorBody) -> None:
        super().__init__(f"{body.kind}: {body.message}")
        self.body = body


class SupervisorClient:
    def __init__(
        self,
        *,
        socket_path: Path | None = None,
        address: tuple[str, int] | None = None,
        token: str | None = None,
        cafile: Path | None = None,
        server_hostname: str | None = None,
        timeout: float | None = 60.0,
    ) -> None:
        if (socket_path is None) == (address is None):
            raise ValueError("give exactly one of socket_path or address")
        raw: socket.socket
        if socket_path is not None:
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.settimeout(timeout)
            try:
                connect(raw, socket_path)
            except OSError as exc:
                raw.close()
                raise ConnectionError(
                    f"cannot connect to the daemon at {socket_path}: {exc.strerror or exc}"
                ) from None
            self._sock: socket.socket = raw
        else:
            assert address is not None
            context = ssl.create_default_context(cafile=str(cafile) if cafile else None)
            raw = socket.create_connection(address, timeout=timeout)
            self._sock = context.wrap_socket(raw, server_hostname=server_hostname or address[0])
        self._file = self._sock.makefile("rwb")
        if address is not None and token is not None:
            self._file.write(json.dumps({"bearer": token}).encode() + b"\n")
            self._file.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()
        self._sock.close()

    def call_raw(self, line: bytes) -> dict[str, Any]:
        """Send one raw line (newline added if missing) and return the decoded reply."""
        if not line.endswith(b"\n"):
            line += b"\n"
        self._file.write(line)
        self._file.flush()
        reply = self._file.readline()
        if not reply:
            raise ConnectionError("the daemon closed the connection")
        decoded: dict[str, Any] = json.loads(reply)
        return decoded

    def call(self, kind: str, **fields: Any) -> proto.Reply:
        """Send a request; return the reply, or raise ``ControlError`` for an error reply."""
        message: dict[str, Any] = {"kind": kind, **fields}
        reply = proto.parse_reply(json.dumps(self.call_raw(json.dumps(message).encode())))
        if isinstance(reply, proto.ErrorReply):
            raise ControlError(reply.error)
        return reply

    # Typed conveniences: each returns the reply the protocol table promises.

    def agents(self) -> list[proto.AgentRecord]:
        reply = self.call("list")
        assert isinstance(reply, proto.Listed)
        return reply.agents

    def spawn(self, **spec: Any) -> proto.Spawned:
        """Start an agent; a field given as None is left out (the worker's default: an
        upstream spec has no null ``initial_prompt``)."""
        reply = self.call("spawn", spec={k: v for k, v in spec.items() if v is not None})
        assert isinstance(reply, proto.Spawned)
        return reply

    def drain(self, grace_secs: float) -> list[proto.ResumeRef]:
        reply = self.call("drain", grace=_duration(grace_secs))
        assert isinstance(reply, proto.Drained)
        return reply.agents

    def retire(self, keep: int, grace_secs: float) -> list[proto.ResumeRef]:
        """Scale down to ``keep`` agents; the refs of the agents retired."""
        reply = self.call("retire", keep=keep, grace=_duration(grace_secs))
        assert isinstance(reply, proto.Retired)
        return reply.agents

    def resume(
        self,
        session_dir: str,
        *,
        expect_turns: int | None = None,
        expect_sha256: str | None = None,
        provider: str | None = None,
        model: str | None = None,
    ) -> proto.Resumed:
        """Resume one agent; with ``expect_*`` only if its session is what a checkpoint
        recorded (otherwise ``ControlError`` ``invalid_state`` saying how it differs);
        with ``provider``/``model``, continuing with those from now on."""
        fields: dict[str, object] = {"session_dir": session_dir}
        optional = {
            "expect_turns": expect_turns,
            "expect_sha256": expect_sha256,
            "provider": provider,
            "model": model,
        }
        fields.update({k: v for k, v in optional.items() if v is not None})
        reply = self.call("resume", **fields)
        assert isinstance(reply, proto.Resumed)
        return reply

    def status(self) -> proto.StatusReply:
        reply = self.call("status")
        assert isinstance(reply, proto.StatusReply)
        return reply

    def attach(self, agent_id: str) -> proto.UnixEndpoint | proto.TcpEndpoint:
        """The live agent's attach endpoint."""
        reply = self.call("attach", id=agent_id)
        assert isinstance(reply, proto.AttachAck)
        return reply.endpoint

    def prompt(self, agent_id: str, text: str) -> int:
        """Queue ``text`` as the live agent's next turn, through its attach endpoint; the
        prompts now queued. ``PromptRefused`` if the agent does not take it."""
        return send_prompt(self.attach(agent_id), text, timeout=self._sock.gettimeout())


class PromptRefused(Exception):
    """The agent's attach endpoint did not accept a prompt; the message says why."""


def send_prompt(
    endpoint: proto.UnixEndpoint | proto.TcpEndpoint, text: str, *, timeout: float | None = 60.0
) -> int:
    """Send one ``{"kind": "prompt"}`` line to an agent's attach endpoint (a Unix socket,
    the reference worker's protocol: docs/daemon.md); the prompts now queued."""
    if not isinstance(endpoint, proto.UnixEndpoint):
        raise PromptRefused(f"attach endpoint {endpoint} is not a Unix socket")
    path = endpoint.path
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(timeout)
        try:
            connect(raw, path)
        except OSError as exc:
            raise ConnectionError(
                f"cannot connect to the agent at {path}: {exc.strerror or exc}"
            ) from None
        with raw.makefile("rwb") as stream:
            stream.write(json.dumps({"kind": "prompt", "text": text}).encode() + b"\n")
            stream.flush()
            line = stream.readline()
    if not line:
        raise PromptRefused(f"the agent at {path} closed the connection without a reply")
    reply = json.loads(line)
    if not isinstance(reply, dict) or reply.get("kind") != "accepted":
        error = reply.get("error") if isinstance(reply, dict) else reply
        raise PromptRefused(f"the agent refused the prompt: {error}")
    return int(reply.get("queued", 0))


def _duration(seconds: float) -> dict[str, int]:
    """A grace as the serde ``Duration`` the protocol carries; a bad one is refused here."""
    return proto.Duration.of(seconds).model_dump()
