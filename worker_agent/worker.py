"""The reference agent worker: one conversation, honouring the flush-on-SIGTERM contract.

Run by the daemon with upstream caliban's worker arguments, ``python -m
worker_agent.worker __agent-worker --manifest M --socket S --control-socket C``: the
manifest is the agent's record (its spec; ``spec.resume_session`` set means continue
the conversation), the socket its attach endpoint, the control socket the daemon's.
The older ``--session-dir D --agent-id A [--resume]`` still works. The contract it
keeps (any worker program may keep it instead):

- stdout (``stdout.ndjson``) gets upstream caliban's ``TurnEvent`` records
  (``worker_agent.transcript``): ``TurnStart``, ``AssistantTextDelta``, ``TurnEnd`` per
  turn and one ``RunEnd`` on exit;
- after every completed turn, ``session.json`` (upstream's ``PersistedSession`` plus our
  ``caliban_drain`` key) is rewritten atomically and durably, *then* the turn's
  ``TurnEnd`` is appended to stdout;
- on SIGTERM it takes no new input, finishes the in-flight turn if that fits in half the
  time left before the daemon's drain deadline, otherwise abandons it (it is re-run on
  resume), writes ``session.json`` and exits 0;
- with a provider that ``exits_when_done`` (the scripted ``then=exit``), once its scripted
  turns are over and no prompt is queued it ends with ``RunEnd`` ``stopped_for:
  EndOfTurn`` (``caliban_drain.stop: finished``) and exits 0 by itself:
  the daemon records the agent ``done``, its work over;
- a turn its provider cannot answer ends the worker with exit 5 (``EXIT_TURN_FAILED``),
  never 0: its work is not over (``RunEnd`` ``stopped_for: {"ProviderError": ...}``);
- on ``--resume`` it loads ``session.json``, refuses a corrupt one (exit 2, the reason
  on stderr) and continues at turn ``turns + 1`` with the old messages as a prefix; a
  session upstream's types wrote (no ``caliban_drain``) is adopted as this agent's;
- it reports ``running``/``idle`` to the daemon and holds ``worker.lock`` while it runs,
  so two workers never write one session dir.

Standard library only, so a hundred of them start quickly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from worker_agent import transcript
from worker_agent.children import die_with_parent
from worker_agent.exiting import exit_now
from worker_agent.layout import lock_file, session_file
from worker_agent.providers import ProviderError, make_provider
from worker_agent.session import (
    DRAIN_DEADLINE_ENV,
    ORIGIN_UPSTREAM,
    Session,
    SessionError,
    check_transcript,
    load_session,
    message_text,
    save_session,
    text_message,
    utc_timestamp,
)
from worker_agent.unixpath import bound, connected

EXIT_BAD_SESSION = 2
EXIT_LOCKED = 3
EXIT_BAD_CONFIG = 4
EXIT_TURN_FAILED = 5
"""The provider could not answer a turn (its endpoint down, a malformed reply): the work
is not over, so the worker must not exit 0, which the daemon reads as ``done`` (finished,
never resumed; a task whose agents are all done completes). Non-zero makes the agent
``failed``: resumed after a disruption, the failed turn re-run."""


def emit(event: dict[str, Any], **ours: Any) -> None:
    """Append one ``TurnEvent`` line to stdout with a single write, so lines never
    interleave; ``ours`` goes in its ``caliban_drain`` key."""
    transcript.write(1, transcript.encode(event, **ours))


def provider_view(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as providers take it: ``{role, content: text}``."""
    return [{"role": m["role"], "content": message_text(m)} for m in messages]


def fail(code: int, message: str) -> int:
    sys.stderr.write(f"worker: {message}\n")
    sys.stderr.flush()
    return code


class Reporter:
    """``report_status`` over the daemon's control socket; EOF means the daemon is gone."""

    def __init__(self, agent_id: str, socket_path: str | None, on_lost: asyncio.Event) -> None:
        self.agent_id = agent_id
        self.socket_path = socket_path
        self.on_lost = on_lost
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()

    async def connect(self) -> None:
        if not self.socket_path:
            return
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(
                sock=connected(self.socket_path)
            )
        except OSError as exc:
            sys.stderr.write(f"worker: no status reports, cannot reach daemon: {exc}\n")

    async def report(self, status: str, turns: int) -> None:
        if self._writer is None or self._reader is None:
            return
        message = {"kind": "report_status", "id": self.agent_id, "status": status, "turns": turns}
        async with self._lock:
            try:
                self._writer.write(json.dumps(message).encode() + b"\n")
                await self._writer.drain()
                if not await self._reader.readline():
                    raise ConnectionError("daemon closed the control connection")
            except (ConnectionError, OSError):
                self._writer = None
                self.on_lost.set()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()


class Worker:
    def __init__(self, args: argparse.Namespace, session: Session, *, unsaved: bool) -> None:
        self.session_dir: Path = args.session_dir
        self.session = session
        self.unsaved = unsaved
        """True until session.json holds exactly ``self.session``."""
        env = os.environ
        self.provider = make_provider(
            args.provider or env.get("CALIBAN_PROVIDER") or "scripted",
            args.model if args.model is not None else env.get("CALIBAN_MODEL", ""),
            env,
            args.initial_prompt or env.get("CALIBAN_INITIAL_PROMPT") or None,
        )
        self.grace_hint = float(env.get("CALIBAN_DRAIN_GRACE_SECS", "30"))
        self.stop = asyncio.Event()
        self.inbox: asyncio.Queue[str] = asyncio.Queue()
        self.reporter = Reporter(
            args.agent_id,
            str(args.control_socket or "") or env.get("CALIBAN_SUPERVISOR_SOCKET"),
            on_lost=self.stop,
        )
        self.agent_socket = str(args.socket or "") or env.get("CALIBAN_AGENT_SOCKET")
        self.exit_code = 0
        self.agent_id: str = args.agent_id
        self.model = args.model if args.model is not None else env.get("CALIBAN_MODEL", "")
        self.turns_run = 0
        self.stopped_for: str | dict[str, Any] = transcript.CANCELLED
        self.stop_kind = "drain"
        self.abandoned_turn: int | None = None

    @property
    def ignores_sigterm(self) -> bool:
        return bool(getattr(getattr(self.provider, "config", None), "ignore_sigterm", False))

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        if self.ignores_sigterm:
            loop.add_signal_handler(signal.SIGTERM, lambda: None)
        else:
            loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        loop.add_signal_handler(signal.SIGINT, self.stop.set)
        if _early_stop and not self.ignores_sigterm:
            self.stop.set()
        await self.reporter.connect()
        server = await self._serve_input()
        try:
            await self._converse()
        finally:
            if self.unsaved:
                self._save()
            end = transcript.run_end(
                self.session.messages,
                self.session.extra.get("total_usage", transcript.ZERO_USAGE),
                self.turns_run,
                self.stopped_for,
            )
            ours: dict[str, Any] = {"turns": self.session.turns, "stop": self.stop_kind}
            if self.abandoned_turn is not None:
                ours["abandoned_turn"] = self.abandoned_turn
            emit(end, **ours)
            if server is not None:
                server.close()
            await self.reporter.close()
        return self.exit_code

    async def _converse(self) -> None:
        while not self.stop.is_set():
            turn = self.session.turns + 1
            prompt = self.provider.scripted_prompt(turn)
            if prompt is None and self.provider.exits_when_done:
                if self.inbox.empty():
                    # Its work is over: exit 0 by itself (``run`` saves session.json and
                    # writes RunEnd), which the daemon records as ``done``.
                    self.stopped_for, self.stop_kind = transcript.END_OF_TURN, "finished"
                    return
                prompt = self.inbox.get_nowait()  # a prompt queued before the end is answered
            if prompt is None:
                await self.reporter.report("idle", self.session.turns)
                prompt = await self._next_input()
                if prompt is None:
                    return
            await self.reporter.report("running", self.session.turns)
            if not await self._turn(turn, prompt):
                return

    async def _next_input(self) -> str | None:
        getter = asyncio.ensure_future(self.inbox.get())
        stopper = asyncio.ensure_future(self.stop.wait())
        done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for pending in (getter, stopper):
            pending.cancel()
        return getter.result() if getter in done and not getter.cancelled() else None

    async def _turn(self, turn: int, prompt: str) -> bool:
        """Run one turn; False if it was abandoned for a drain."""
        started = time.monotonic()
        emit(transcript.turn_start(turn, f"{self.agent_id}-turn-{turn}", self.model))
        messages = [*self.session.messages, text_message("user", prompt)]
        answer = asyncio.ensure_future(self.provider.reply(provider_view(messages)))
        stopper = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({answer, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not answer.done():
            await asyncio.wait({answer}, timeout=self._finish_budget())
        if not answer.done():
            answer.cancel()
            self.abandoned_turn = turn  # re-run on resume
            return False
        try:
            text = answer.result()
        except ProviderError as exc:
            self.stopped_for = transcript.provider_error(str(exc))
            self.stop_kind = "failed"
            sys.stderr.write(f"worker: turn {turn} failed, stopping: {exc}\n")
            self.exit_code = EXIT_TURN_FAILED
            self.stop.set()
            return False
        ttft = time.monotonic() - started
        emit(transcript.text_delta(turn, text))
        reply = text_message("assistant", text)
        self.session = replace(self.session, turns=turn, messages=[*messages, reply])
        sha = self._save()
        self.turns_run += 1
        emit(transcript.turn_end(turn, reply, ttft=ttft), turn=turn, session_sha256=sha)
        return True

    def _save(self) -> str:
        """Write session.json, naming the provider and model the conversation now uses."""
        now = utc_timestamp()
        extra = {
            "created_at": now,
            **self.session.extra,
            "updated_at": now,
            "provider": self.provider.name,
            "model": self.model,
        }
        self.session = replace(self.session, extra=extra)
        sha = save_session(self.session_dir, self.session)
        self.unsaved = False
        return sha

    def _finish_budget(self) -> float:
        """Half the time left before the daemon's drain deadline (or the grace hint)."""
        try:
            deadline = float(Path(os.environ[DRAIN_DEADLINE_ENV]).read_text())
        except (KeyError, OSError, ValueError):
            return self.grace_hint / 2
        return max(0.0, (deadline - time.time()) / 2)

    async def _serve_input(self) -> asyncio.AbstractServer | None:
        """The attach endpoint: ``{"kind": "prompt", "text": ...}`` queues a turn."""
        if not self.agent_socket:
            return None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.agent_socket)
        try:
            return await asyncio.start_unix_server(self._attach, sock=bound(self.agent_socket))
        except OSError as exc:
            sys.stderr.write(f"worker: attach endpoint unavailable: {exc}\n")
            return None

    async def _attach(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, ValueError):
            while line := await reader.readline():
                writer.write(json.dumps(self._on_input(line)).encode() + b"\n")
                await writer.drain()
        writer.close()

    def _on_input(self, line: bytes) -> dict[str, Any]:
        try:
            request = json.loads(line)
        except ValueError:
            return {"kind": "error", "error": "input is not valid JSON"}
        if not isinstance(request, dict):
            return {"kind": "error", "error": "input must be a JSON object"}
        if request.get("kind") == "status":
            return {"kind": "status", "turns": self.session.turns, "queued": self.inbox.qsize()}
        if request.get("kind") != "prompt" or not isinstance(request.get("text"), str):
            return {"kind": "error", "error": "expected {'kind': 'prompt', 'text': str}"}
        if self.stop.is_set():
            return {"kind": "error", "error": "the agent is draining; prompt not accepted"}
        self.inbox.put_nowait(request["text"])
        return {"kind": "accepted", "queued": self.inbox.qsize()}


def recover_transcript(session_dir: Path, session: Session) -> None:
    """Re-emit ``TurnEnd`` for the turn saved but not yet announced (a SIGKILL between the
    two writes), so the transcript again has exactly one per completed turn.
    ``check_transcript`` has refused a session that is further ahead than that, unless
    upstream's types wrote it: then every turn its transcript lacks is announced here."""
    missing = check_transcript(session_dir, session)
    replies = [m for m in session.messages if m.get("role") == "assistant"]
    for turn in range(session.turns - missing + 1, session.turns + 1):
        reply = replies[turn - 1] if turn <= len(replies) else text_message("assistant", "")
        emit(transcript.turn_end(turn, reply), turn=turn, recovered=True)


class BadArguments(Exception):
    """The worker cannot start with these arguments; the message says why, in one line."""


AGENT_WORKER = "__agent-worker"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The worker's arguments: upstream caliban's ``__agent-worker --manifest M --socket S
    [--control-socket C]`` (what the daemon passes), or the older ``--session-dir D
    --agent-id A [--resume]``. Both give the same namespace."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [AGENT_WORKER]:
        return _agent_worker_args(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m worker_agent.worker")
    parser.add_argument("--session-dir", type=Path, required=True)
    parser.add_argument("--agent-id", required=True)
    parser.add_argument("--resume", action="store_true", help="continue session.json")
    parser.add_argument("--provider", default=None)
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    args.socket = args.control_socket = args.initial_prompt = None
    return args


def _agent_worker_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m worker_agent.worker {AGENT_WORKER}")
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--socket", type=Path, default=None)
    parser.add_argument("--listen", default=None)
    parser.add_argument("--control-socket", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.listen is not None:
        raise BadArguments(
            f"--listen {args.listen}: the reference worker serves a Unix socket only; give --socket"
        )
    if args.socket is None:
        raise BadArguments("--socket is required (the agent's attach socket)")
    manifest: Path = args.manifest
    try:
        doc = json.loads(manifest.read_bytes())
    except OSError as exc:
        raise BadArguments(f"cannot read --manifest {manifest}: {exc.strerror}") from None
    except ValueError as exc:
        raise BadArguments(f"--manifest {manifest} is not JSON: {exc}") from None
    spec = doc.get("spec") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("id"), str)
        or not isinstance(spec, dict)
    ):
        raise BadArguments(f"--manifest {manifest} is not an agent record (no id or spec)")
    text = {k: spec.get(k) for k in ("provider", "model", "initial_prompt", "resume_session")}
    wrong = [k for k, v in text.items() if v is not None and not isinstance(v, str)]
    if wrong:
        raise BadArguments(f"--manifest {manifest}: spec.{wrong[0]} must be a string or null")
    # The session dir is the manifest's own directory (the daemon's layout, and
    # upstream's): a path written inside the manifest is not trusted over where it is.
    return argparse.Namespace(
        session_dir=manifest.parent,
        agent_id=doc["id"],
        resume=text["resume_session"] is not None,
        provider=text["provider"],
        model=text["model"],
        initial_prompt=text["initial_prompt"],
        socket=args.socket,
        control_socket=args.control_socket,
    )


_early_stop = False


def _stop_early(signum: int, frame: object) -> None:
    global _early_stop
    _early_stop = True


def main(argv: list[str] | None = None) -> int:
    # A drain can arrive while the worker is still starting: remember it until the event
    # loop takes over, instead of dying of the default SIGTERM action mid-start.
    signal.signal(signal.SIGTERM, _stop_early)
    try:
        args = parse_args(argv)
    except BadArguments as exc:
        return fail(EXIT_BAD_CONFIG, str(exc))
    # When the daemon dies the worker flushes and exits (SIGTERM is its drain signal).
    supervisor_pid = os.environ.get("CALIBAN_SUPERVISOR_PID")
    die_with_parent(signal.SIGTERM, int(supervisor_pid) if supervisor_pid else None)
    session_dir: Path = args.session_dir
    lock_fd = os.open(lock_file(session_dir), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return fail(EXIT_LOCKED, f"{session_dir} is held by another worker; not starting")
    if args.resume:
        try:
            session = load_session(session_dir, agent_id=args.agent_id)
        except SessionError as exc:
            return fail(EXIT_BAD_SESSION, f"cannot resume: {exc}")
        if session.agent_id != args.agent_id:
            return fail(
                EXIT_BAD_SESSION,
                f"cannot resume: session.json belongs to {session.agent_id!r}, "
                f"not {args.agent_id!r}",
            )
        try:
            recover_transcript(session_dir, session)
        except SessionError as exc:
            return fail(EXIT_BAD_SESSION, f"cannot resume: {exc}")
        marker: dict[str, Any] = {"resumed_from": session.turns + 1}
        if session.origin == ORIGIN_UPSTREAM:
            marker["adopted"] = True
        emit(transcript.text_delta(session.turns + 1, ""), **marker)
    else:
        if session_file(session_dir).exists():
            return fail(
                EXIT_BAD_SESSION,
                f"{session_dir} already holds a conversation; start with --resume to continue it",
            )
        session = Session(args.agent_id, 0, [], {"created_at": utc_timestamp()}, "")
    try:
        worker = Worker(args, session, unsaved=not args.resume)
    except ProviderError as exc:
        save_session(session_dir, session)  # provider and model unknown: left empty
        return fail(EXIT_BAD_CONFIG, str(exc))
    code = asyncio.run(worker.run())
    # Everything is saved and announced; skip the interpreter's teardown (about 10 ms a
    # worker, which a drain of a hundred agents would otherwise wait for).
    exit_now(code)


if __name__ == "__main__":
    sys.exit(main())
