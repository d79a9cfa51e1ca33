"""The reference agent worker: one conversation, honouring the flush-on-SIGTERM contract.

Run by the daemon as ``python -m worker_agent.worker --session-dir D --agent-id A
[--resume]``. The contract it keeps (any worker program may keep it instead):

- after every completed turn, ``session.json`` is rewritten atomically and durably,
  *then* the turn's ``turn_complete`` event is appended to stdout (``stdout.ndjson``);
- on SIGTERM it takes no new input, finishes the in-flight turn if that fits in half the
  time left before the daemon's drain deadline, otherwise abandons it (it is re-run on
  resume), writes ``session.json`` and exits 0;
- with a provider that ``exits_when_done`` (the scripted ``then=exit``), once its scripted
  turns are over and no prompt is queued it emits ``finished`` and exits 0 by itself:
  the daemon records the agent ``done``, its work over;
- a turn its provider cannot answer ends the worker with exit 5 (``EXIT_TURN_FAILED``),
  never 0: its work is not over;
- on ``--resume`` it loads ``session.json``, refuses a corrupt one (exit 2, the reason
  on stderr) and continues at turn ``turns + 1`` with the old messages as a prefix;
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
from pathlib import Path
from typing import Any

from worker_agent.children import die_with_parent
from worker_agent.exiting import exit_now
from worker_agent.layout import lock_file, session_file
from worker_agent.providers import ProviderError, make_provider
from worker_agent.session import (
    DRAIN_DEADLINE_ENV,
    Session,
    SessionError,
    check_transcript,
    load_session,
    save_session,
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


def emit(event: dict[str, Any]) -> None:
    """Append one event line to stdout with a single write, so lines never interleave."""
    os.write(1, json.dumps({"ts": round(time.time(), 3), **event}).encode() + b"\n")


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
            args.provider or env.get("CALIBAN_PROVIDER", "scripted"),
            args.model if args.model is not None else env.get("CALIBAN_MODEL", ""),
            env,
            env.get("CALIBAN_INITIAL_PROMPT") or None,
        )
        self.grace_hint = float(env.get("CALIBAN_DRAIN_GRACE_SECS", "30"))
        self.stop = asyncio.Event()
        self.inbox: asyncio.Queue[str] = asyncio.Queue()
        self.reporter = Reporter(
            session.agent_id, env.get("CALIBAN_SUPERVISOR_SOCKET"), on_lost=self.stop
        )
        self.agent_socket = env.get("CALIBAN_AGENT_SOCKET")
        self.exit_code = 0

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
                save_session(self.session_dir, self.session)
            emit({"type": "stopped", "turns": self.session.turns})
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
                    # Its work is over: exit 0 by itself (``run`` has saved session.json),
                    # which the daemon records as ``done``.
                    emit({"type": "finished", "turns": self.session.turns})
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
        emit({"type": "turn_start", "turn": turn})
        messages = [*self.session.messages, {"role": "user", "content": prompt, "turn": turn}]
        answer = asyncio.ensure_future(self.provider.reply(messages))
        stopper = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({answer, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not answer.done():
            await asyncio.wait({answer}, timeout=self._finish_budget())
        if not answer.done():
            answer.cancel()
            emit({"type": "turn_abandoned", "turn": turn, "reason": "drain"})
            return False
        try:
            text = answer.result()
        except ProviderError as exc:
            emit({"type": "turn_failed", "turn": turn, "error": str(exc)})
            sys.stderr.write(f"worker: turn {turn} failed, stopping: {exc}\n")
            self.exit_code = EXIT_TURN_FAILED
            self.stop.set()
            return False
        messages.append({"role": "assistant", "content": text, "turn": turn})
        self.session = Session(
            self.session.agent_id, turn, messages, self.session.extra, self.session.sha256
        )
        sha = save_session(self.session_dir, self.session)
        self.unsaved = False
        emit({"type": "assistant_message", "turn": turn, "chars": len(text)})
        emit({"type": "turn_complete", "turn": turn, "session_sha256": sha})
        return True

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
    """Re-emit ``turn_complete`` for the turn saved but not yet announced (a SIGKILL
    between the two writes), so the transcript again has exactly one per completed turn.
    ``check_transcript`` has refused a session that is further ahead than that."""
    missing = check_transcript(session_dir, session)
    for turn in range(session.turns - missing + 1, session.turns + 1):
        emit({"type": "turn_complete", "turn": turn, "recovered": True})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m worker_agent.worker")
    parser.add_argument("--session-dir", type=Path, required=True)
    parser.add_argument("--agent-id", required=True)
    parser.add_argument("--resume", action="store_true", help="continue session.json")
    parser.add_argument("--provider", default=None)
    parser.add_argument("--model", default=None)
    return parser.parse_args(argv)


_early_stop = False


def _stop_early(signum: int, frame: object) -> None:
    global _early_stop
    _early_stop = True


def main(argv: list[str] | None = None) -> int:
    # A drain can arrive while the worker is still starting: remember it until the event
    # loop takes over, instead of dying of the default SIGTERM action mid-start.
    signal.signal(signal.SIGTERM, _stop_early)
    args = parse_args(argv)
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
            session = load_session(session_dir)
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
        emit({"type": "resumed", "from_turn": session.turns + 1})
    else:
        if session_file(session_dir).exists():
            return fail(
                EXIT_BAD_SESSION,
                f"{session_dir} already holds a conversation; start with --resume to continue it",
            )
        session = Session(args.agent_id, 0, [], {}, "")
        emit({"type": "started", "agent_id": args.agent_id})
    try:
        worker = Worker(args, session, unsaved=not args.resume)
    except ProviderError as exc:
        save_session(session_dir, session)
        return fail(EXIT_BAD_CONFIG, str(exc))
    code = asyncio.run(worker.run())
    # Everything is saved and announced; skip the interpreter's teardown (about 10 ms a
    # worker, which a drain of a hundred agents would otherwise wait for).
    exit_now(code)


if __name__ == "__main__":
    sys.exit(main())
