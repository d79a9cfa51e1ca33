"""The supervisor: what each control verb does to the registry, the store and workers.

``server`` decodes requests and hands them here; this module never sees a socket.
Drain is "checkpoint, then stop": SIGTERM to every live agent at once, wait up to the
grace, SIGKILL only stragglers, then verify every session dir and answer one
``ResumeRef`` per agent. Refs are derived from the manifests and the files alone, so a
second drain of a drained daemon answers the same refs.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from worker_agent import proto
from worker_agent.layout import (
    AGENT_SOCKET_FILE,
    drain_deadline_file,
    manifest_file,
    session_file,
    stderr_file,
    transcript_file,
)
from worker_agent.process import LaunchError, WorkerProcess, render_command
from worker_agent.proto import AgentRecord, AgentStatus, ErrorKind, ProtocolError, ResumeRef
from worker_agent.registry import Agent, Registry
from worker_agent.session import (
    DRAIN_DEADLINE_ENV,
    MAX_SESSION_BYTES,
    SessionError,
    atomic_write,
    decode_session,
    load_session,
)
from worker_agent.settings import DaemonSettings
from worker_agent.store import Store, lock_is_held

log = logging.getLogger(__name__)

LOCK_WAIT_SECS = 10.0
"""How long a resume waits for a previous worker of the same session to let go of it."""


class Supervisor:
    def __init__(self, settings: DaemonSettings) -> None:
        self.settings = settings
        self.store = Store(settings.store)
        self.registry = Registry(self.store)
        self.started_at = time.monotonic()
        self.socket_path = settings.socket_path().resolve()
        self.deadline_file = drain_deadline_file(self.store.root)
        self._drain: asyncio.Task[list[ResumeRef]] | None = None
        self._drained_refs: dict[str, ResumeRef] = {}
        """Agent id → the ref made when a drain's worker exited; the drain answers it."""
        self.stopping = asyncio.Event()

    def open(self) -> None:
        """Take the store (refusing one another daemon holds), then load its agents."""
        self.store.lock()
        self.store.prepare()
        crashed = self.registry.reload()
        log.info(
            "store_loaded store=%s agents=%d crashed=%s",
            self.store.root,
            len(self.registry),
            ",".join(crashed) or "-",
        )

    async def spawn_initial(self) -> None:
        """Start ``initial_agents`` agents if this store has never held one."""
        if len(self.registry) or not self.settings.initial_agents:
            return
        spec = proto.SpawnSpec(
            provider=self.settings.initial_provider,
            model=self.settings.initial_model,
            initial_prompt=self.settings.initial_prompt or "",
        )
        for _ in range(self.settings.initial_agents):
            await self.spawn(spec)
        log.info("initial_agents_spawned count=%d", self.settings.initial_agents)

    # ------------------------------------------------------------------ verbs

    async def handle(self, request: proto.Request) -> proto.Reply:
        try:
            return await self._dispatch(request)
        except ProtocolError as exc:
            # Upstream's invalid_state names the verb and the agent's status: fill them in
            # for refusals raised where neither is known (the store's checks).
            if exc.kind is ErrorKind.INVALID_STATE and exc.agent_id is not None:
                exc.op = exc.op or request.kind
                agent = self.registry.find(exc.agent_id)
                if exc.status is None and agent is not None:
                    exc.status = agent.record.status
            raise

    async def _dispatch(self, request: proto.Request) -> proto.Reply:
        match request:
            case proto.ListRequest():
                return proto.Listed(agents=[a.record for a in self.registry])
            case proto.SpawnRequest(spec=spec):
                return await self.spawn(spec)
            case proto.AttachRequest(id=agent_id):
                return proto.AttachAck(endpoint=self._attach(agent_id))
            case proto.KillRequest(id=agent_id):
                return await self.kill(agent_id)
            case proto.RespawnRequest(id=agent_id):
                return await self.respawn(agent_id)
            case proto.RmRequest(id=agent_id, force=force):
                return await self.rm(agent_id, force=force)
            case proto.StatusRequest():
                return proto.StatusReply(
                    pid=os.getpid(),
                    agents=len(self.registry),
                    uptime_secs=int(time.monotonic() - self.started_at),
                    endpoint=proto.UnixEndpoint(path=str(self.socket_path)),
                )
            case proto.ShutdownRequest():
                self.stopping.set()
                return proto.ShutdownAck()
            case proto.ReportStatusRequest(id=agent_id, status=status, turns=turns):
                self._report_status(agent_id, status, turns)
                return proto.StatusReported()
            case proto.DrainRequest(grace=grace):
                return proto.Drained(agents=await self.drain(grace.seconds))
            case proto.RetireRequest(keep=keep, grace=grace):
                return proto.Retired(agents=await self.retire(keep, grace.seconds))
            case proto.ResumeRequest(session_dir=session_dir):
                session = self.store.resolve_session_dir(session_dir)
                self.store.check_expected(session, request.expect_turns, request.expect_sha256)
                existing = self.registry.find(session.name)
                spec = existing.record.spec if existing else proto.SpawnSpec()
                chosen = {"provider": request.provider, "model": request.model}
                spec = spec.model_copy(update={k: v for k, v in chosen.items() if v is not None})
                agent = await self._resume(session, spec)
                return proto.Resumed(id=agent.id, endpoint=self._endpoint(agent))
        raise ProtocolError(ErrorKind.BAD_REQUEST, f"unhandled request {request!r}")

    def _refuse_while_draining(self, verb: str) -> None:
        # Stopping first: a daemon that stops drains too, and what a caller must know is
        # that this daemon will not serve it at all (the next one on the store will).
        if self.stopping.is_set():
            raise ProtocolError(ErrorKind.INVALID_STATE, f"cannot {verb}: {proto.DAEMON_STOPPING}")
        if self._drain is not None and not self._drain.done():
            raise ProtocolError(ErrorKind.INVALID_STATE, f"cannot {verb}: the daemon is draining")

    async def spawn(self, spec: proto.SpawnSpec) -> proto.Spawned:
        self._refuse_while_draining("spawn")
        if spec.resume_session is not None:
            session = self.store.resolve_session_dir(spec.resume_session)
            agent = await self._resume(session, spec.model_copy(update={"resume_session": None}))
            return proto.Spawned(id=agent.id, endpoint=self._endpoint(agent))
        if len(self.registry) >= self.settings.max_agents:
            raise ProtocolError(
                ErrorKind.INVALID_STATE,
                f"cannot spawn: this daemon holds {len(self.registry)} agents, its limit "
                f"(--max-agents {self.settings.max_agents}); rm finished agents first",
            )
        agent_id = self.store.new_agent_id()
        directory = self.store.agent_dir(agent_id)
        directory.mkdir(mode=0o700)
        agent = self.registry.add(_new_record(directory, spec))
        self._launch(agent, resume=False)
        return proto.Spawned(id=agent.id, endpoint=self._endpoint(agent))

    async def _resume(self, session_dir: Path, spec: proto.SpawnSpec) -> Agent:
        self._refuse_while_draining("resume")
        agent_id = session_dir.name
        existing = self.registry.find(agent_id)
        if existing is not None and existing.live:
            raise ProtocolError(
                ErrorKind.INVALID_STATE,
                f"agent {agent_id} is {existing.record.status}; drain or kill it before resuming",
                agent_id,
            )
        turns = self.store.check_resumable(session_dir)
        deadline = time.monotonic() + LOCK_WAIT_SECS
        while lock_is_held(session_dir):
            if time.monotonic() > deadline:
                raise ProtocolError(
                    ErrorKind.INVALID_STATE,
                    f"agent {agent_id}: a previous worker still holds its session dir",
                    agent_id,
                )
            await asyncio.sleep(0.05)
        # The wait above yields to the event loop: a drain (or shutdown) that began
        # meanwhile must not get a worker launched behind its back, which it would then
        # report stopped and clean while the worker keeps taking turns.
        self._refuse_while_draining("resume")
        if existing is None:
            agent = self.registry.add(_new_record(session_dir, spec, turns=turns))
        else:
            agent = existing
            agent.stop_reason = None
            agent.force_killed = False
            self.registry.update(
                agent,
                status=AgentStatus.SPAWNING,
                spec=spec,
                turns=turns,
                exit=None,
                error=None,
                idle_since=None,
                retired=False,
            )
        self._launch(agent, resume=True)
        log.info("agent_resumed agent=%s from_turn=%d", agent_id, turns + 1)
        return agent

    def _launch(self, agent: Agent, *, resume: bool) -> None:
        """Start the agent's worker with upstream's ``__agent-worker`` arguments: its
        ``manifest.json`` (written first: the worker reads its spec there, and on a resume
        ``spec.resume_session`` names the session to continue), the socket it binds and
        the daemon's control socket it reports to."""
        directory = Path(agent.record.session_dir)
        resume_session = str(directory) if resume else None
        if agent.record.spec.resume_session != resume_session:
            spec = agent.record.spec.model_copy(update={"resume_session": resume_session})
            self.registry.update(agent, spec=spec)
        spec = agent.record.spec
        values = {
            "python": self.settings.python,
            "manifest": str(manifest_file(directory)),
            "socket": str(directory / AGENT_SOCKET_FILE),
            "control_socket": str(self.socket_path),
            "session_dir": str(directory),
            "agent_id": agent.id,
            "provider": spec.provider or "",
            "model": spec.model or "",
            "resume": "--resume" if resume else "",
        }
        env = {
            **os.environ,
            **spec.env,
            "CALIBAN_AGENT_ID": agent.id,
            "CALIBAN_SESSION_DIR": str(directory),
            "CALIBAN_SUPERVISOR_SOCKET": str(self.socket_path),
            "CALIBAN_SUPERVISOR_PID": str(os.getpid()),
            "CALIBAN_AGENT_SOCKET": str(directory / AGENT_SOCKET_FILE),
            "CALIBAN_PROVIDER": spec.provider or "",
            "CALIBAN_MODEL": spec.model or "",
            "CALIBAN_INITIAL_PROMPT": spec.initial_prompt,
            "CALIBAN_DRAIN_GRACE_SECS": str(self.settings.drain_grace_secs),
            DRAIN_DEADLINE_ENV: str(self.deadline_file),
        }
        cwd = Path(spec.cwd) if spec.cwd else directory
        try:
            argv = render_command(self.settings.worker_command, values)
            process = WorkerProcess.start(
                argv,
                env=env,
                cwd=cwd,
                stdout=transcript_file(directory),
                stderr=stderr_file(directory),
                nice=self.settings.worker_nice,
            )
        except LaunchError as exc:
            self.registry.update(agent, status=AgentStatus.FAILED, error=str(exc))
            raise ProtocolError(ErrorKind.INTERNAL, str(exc), agent.id) from None
        agent.process = process
        agent.watcher = asyncio.get_running_loop().create_task(self._watch_exit(agent, process))
        log.info("agent_started agent=%s pid=%d resume=%s", agent.id, process.pid, resume)

    async def _watch_exit(self, agent: Agent, process: WorkerProcess) -> None:
        code = await process.exited
        if not await process.kill_group():
            log.warning("agent_group_lingers agent=%s pgid=%d", agent.id, process.pid)
        if agent.process is not process:
            return
        agent.process = None
        if agent.stop_reason is not None:
            status = agent.stop_reason
        else:
            status = AgentStatus.DONE if code == 0 else AgentStatus.FAILED
        if status is AgentStatus.DRAINED:
            await self._drained_exit(agent, code)
            return
        turns = agent.record.turns
        with contextlib.suppress(SessionError):
            turns = load_session(Path(agent.record.session_dir)).turns
        if self.registry.find(agent.id) is agent:
            self.registry.update(agent, status=status, exit=code, turns=turns, idle_since=None)
        log.info("agent_exited agent=%s exit=%d status=%s turns=%d", agent.id, code, status, turns)

    async def _drained_exit(self, agent: Agent, code: int) -> None:
        """Record the exit of a worker a drain stopped, and its ``ResumeRef`` for the
        drain's answer, while the other workers are still exiting.

        Its session dir is final (the worker is reaped and its group killed), so the ref
        verified now is the one the drain answers. The session is read and the manifest
        written in a thread, not on the event loop, which meanwhile reaps the others:
        a rename over the old manifest can wait on the disk (ext4 flushes the new data
        on it) while a hundred workers fsync their sessions. The drain makes every
        manifest durable in one sync before it replies; until then the manifest still
        says the agent was live, which a restarted daemon reads as ``crashed``:
        resumable, the safe side."""
        if self.registry.find(agent.id) is not agent:
            return
        self.registry.update(
            agent, persist=False, status=AgentStatus.DRAINED, exit=code, idle_since=None
        )
        ref = await asyncio.to_thread(self._resume_ref, agent.record)
        self._drained_refs[agent.id] = ref
        self.registry.update(agent, persist=False, turns=ref.turns)
        await asyncio.to_thread(self.registry.save, [agent.record], sync=False)
        log.info("agent_exited agent=%s exit=%d status=drained turns=%d", agent.id, code, ref.turns)

    def _endpoint(self, agent: Agent) -> proto.UnixEndpoint:
        return proto.UnixEndpoint(path=str(Path(agent.record.session_dir) / AGENT_SOCKET_FILE))

    def _attach(self, agent_id: str) -> proto.UnixEndpoint:
        agent = self.registry.get(agent_id)
        if not agent.live:
            raise ProtocolError(
                ErrorKind.INVALID_STATE,
                f"agent {agent_id} is {agent.record.status}; resume it before attaching",
                agent_id,
            )
        return self._endpoint(agent)

    def _report_status(self, agent_id: str, status: AgentStatus, turns: int | None) -> None:
        agent = self.registry.get(agent_id)
        if status not in (AgentStatus.RUNNING, AgentStatus.IDLE):
            return  # upstream's worker reports its end too; its exit is what counts here
        if agent.record.status not in (AgentStatus.SPAWNING, AgentStatus.RUNNING, AgentStatus.IDLE):
            # A report racing a drain or kill must not bring the agent back to life.
            return
        idle_since = None
        if status is AgentStatus.IDLE:
            idle_since = agent.record.idle_since or time.time()
        changes: dict[str, Any] = {"status": status, "idle_since": idle_since}
        if turns is not None:
            changes["turns"] = turns
        # Running/idle is volatile: a restarted daemon marks live agents crashed whatever
        # they last said, so reports stay in memory and cost the event loop nothing.
        self.registry.update(agent, persist=False, **changes)

    async def kill(self, agent_id: str) -> proto.Killed:
        agent = self.registry.get(agent_id)
        process = agent.process
        if process is None:
            raise ProtocolError(
                ErrorKind.INVALID_STATE,
                f"agent {agent_id} is {agent.record.status}, not running",
                agent_id,
            )
        agent.stop_reason = AgentStatus.KILLED
        code = await process.terminate(self.settings.kill_grace_secs)
        await self._settled(agent)
        return proto.Killed(id=agent_id, exit=code)

    async def respawn(self, agent_id: str) -> proto.Respawned:
        self._refuse_while_draining("respawn")
        agent = self.registry.get(agent_id)
        if agent.live:
            raise ProtocolError(
                ErrorKind.INVALID_STATE, f"agent {agent_id} is {agent.record.status}", agent_id
            )
        directory = Path(agent.record.session_dir)
        if session_file(directory).exists():
            await self._resume(directory, agent.record.spec)
        else:
            agent.stop_reason = None
            agent.force_killed = False
            self.registry.update(agent, status=AgentStatus.SPAWNING, exit=None, error=None)
            self._launch(agent, resume=False)
        return proto.Respawned(id=agent_id)

    async def rm(self, agent_id: str, *, force: bool) -> proto.Removed:
        agent = self.registry.get(agent_id)
        if agent.live and not force:
            raise ProtocolError(
                ErrorKind.INVALID_STATE,
                f"agent {agent_id} is {agent.record.status}; kill it first or pass force",
                agent_id,
            )
        if agent.process is not None:
            agent.stop_reason = AgentStatus.KILLED
            await agent.process.terminate(self.settings.kill_grace_secs)
            await self._settled(agent)
        self.store.remove_agent_dir(agent_id)
        self.registry.remove(agent_id)
        log.info("agent_removed agent=%s", agent_id)
        return proto.Removed(id=agent_id)

    async def _settled(self, agent: Agent) -> None:
        """Wait until the exit watcher has recorded the agent's final status."""
        if agent.watcher is not None:
            await asyncio.shield(agent.watcher)

    # ------------------------------------------------------------------ drain

    async def drain(self, grace: float) -> list[ResumeRef]:
        """Checkpoint, then stop. Concurrent drains share one run."""
        if self._drain is None or self._drain.done():
            self._drain = asyncio.get_running_loop().create_task(self._drain_all(grace))
        return await asyncio.shield(self._drain)

    async def _drain_all(self, grace: float) -> list[ResumeRef]:
        started = time.monotonic()
        stopping = [a for a in self.registry.live() if a.process is not None]
        stragglers = await self._stop_gracefully(stopping, grace)
        # A retired agent is in the checkpoint of the scale-down that retired it, no
        # longer in the task's: it stays out of every later checkpoint.
        refs = await self._verified_refs(self.registry.active(), stopping)
        log.info(
            "drained agents=%d stopped=%d killed=%d unclean=%d secs=%.3f",
            len(refs),
            len(stopping),
            len(stragglers),
            sum(not r.clean for r in refs),
            time.monotonic() - started,
        )
        return refs

    async def retire(self, keep: int, grace: float) -> list[ResumeRef]:
        """Scale down to ``keep`` agents: the task's agents beyond its ``keep`` oldest are
        drained, as a drain drains them, and kept on disk as ``retired``.

        Each is marked retired, durably, before its worker is signalled: from then on no
        heartbeat counts it and no recovery resumes it, even if this daemon dies before
        the drain ends (a restarted daemon finds it retired, not crashed work of the
        task). Answers the refs of the agents retired, verified like a drain's."""
        self._refuse_while_draining("retire")
        started = time.monotonic()
        leaving = self.registry.active()[keep:]
        for agent in leaving:
            self.registry.update(agent, retired=True)
        stopping = [a for a in leaving if a.process is not None]
        stragglers = await self._stop_gracefully(stopping, grace)
        refs = await self._verified_refs(leaving, stopping)
        log.info(
            "retired agents=%d kept=%d stopped=%d killed=%d unclean=%d secs=%.3f",
            len(refs),
            len(self.registry.active()),
            len(stopping),
            len(stragglers),
            sum(not r.clean for r in refs),
            time.monotonic() - started,
        )
        return refs

    async def _stop_gracefully(self, stopping: list[Agent], grace: float) -> list[Agent]:
        """SIGTERM every one of ``stopping`` at once, wait up to ``grace``, SIGKILL only
        the stragglers (returned); every exit is recorded when this returns."""
        try:
            self.deadline_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            atomic_write(self.deadline_file, str(time.time() + grace).encode(), durable=False)
        except OSError as exc:
            # A full or read-only disk must not stop a drain before it starts: workers
            # without the file fall back to CALIBAN_DRAIN_GRACE_SECS, and every session
            # already on disk is still verified below.
            log.warning("drain_deadline_unwritten path=%s error=%s", self.deadline_file, exc)
        self._drained_refs.clear()
        for agent in stopping:  # signal first; bookkeeping after
            assert agent.process is not None
            agent.stop_reason = AgentStatus.DRAINED
            agent.process.signal(signal.SIGTERM)
        for agent in stopping:
            self.registry.update(agent, persist=False, status=AgentStatus.DRAINING)
        if stopping:
            pending = [a.process.exited for a in stopping if a.process is not None]
            await asyncio.wait(pending, timeout=grace)
        stragglers = [a for a in stopping if a.process is not None and not a.process.exited.done()]
        for agent in stragglers:
            assert agent.process is not None
            agent.force_killed = True
            agent.process.signal(signal.SIGKILL)
            log.warning("agent_drain_killed agent=%s grace_secs=%s", agent.id, grace)
        for agent in stopping:
            await self._settled(agent)
        with contextlib.suppress(FileNotFoundError):
            self.deadline_file.unlink()
        return stragglers

    async def _verified_refs(self, agents: list[Agent], stopped: list[Agent]) -> list[ResumeRef]:
        """One verified ``ResumeRef`` per agent, its record's turns brought in line: for
        the agents ``stopped`` by this drain the ref made as each exited
        (``_drained_exit``), for the others one made now. When any agent was stopped,
        every manifest is made durable by one syncfs of the store before the refs are
        answered."""
        just_stopped = {a.id for a in stopped}
        refs = []
        changed = []
        never_saved = []
        for agent in agents:
            ref = self._drained_refs.pop(agent.id, None) if agent.id in just_stopped else None
            if ref is None:
                ref = self._resume_ref(agent.record)
            if _never_saved(ref, Path(agent.record.session_dir)):
                # Spawned, then drained before its first turn was saved: it holds nothing
                # a checkpoint could keep, and a resume of it could only fail. Out of the
                # checkpoint, retired so that no recovery or heartbeat counts it again.
                self.registry.update(agent, persist=False, retired=True)
                changed.append(agent.record)
                never_saved.append(agent.id)
                continue
            if agent.record.turns != ref.turns:
                self.registry.update(agent, persist=False, turns=ref.turns)
                changed.append(agent.record)
            refs.append(ref)
        if never_saved:
            log.info("never_saved agents=%s: left out of the checkpoint", ",".join(never_saved))
        if changed or stopped:
            await asyncio.to_thread(self.registry.save, changed, sync=bool(stopped))
        return refs

    def _resume_ref(self, record: AgentRecord) -> ResumeRef:
        """The ref of ``record``'s session as it is on disk (reads files only, so a drain
        runs it in a thread)."""
        directory = Path(record.session_dir)
        try:
            size = session_file(directory).stat().st_size
            if size > MAX_SESSION_BYTES:
                raise OSError(errno.EFBIG, f"{size} bytes, over the {MAX_SESSION_BYTES} limit")
            raw = session_file(directory).read_bytes()
        except OSError as exc:
            return ResumeRef(
                id=record.id,
                session_dir=self.store.relative(directory),
                turns=record.turns,
                session_sha256=None,
                clean=False,
                exit=record.exit,
                error=f"session.json unreadable: {exc.strerror}",
            )
        error: str | None = None
        turns = record.turns
        try:
            turns = decode_session(raw, source=str(session_file(directory))).turns
        except SessionError as exc:
            error = str(exc)
        if error is None and record.exit not in (0, None):
            error = f"worker exited with {record.exit}"
        return ResumeRef(
            id=record.id,
            session_dir=self.store.relative(directory),
            turns=turns,
            session_sha256=hashlib.sha256(raw).hexdigest(),
            clean=error is None,
            exit=record.exit,
            error=error,
        )

    async def close(self) -> None:
        """Drain (with the configured grace) and stop: the pod-deletion safety net."""
        await self.drain(self.settings.drain_grace_secs)


def _new_record(directory: Path, spec: proto.SpawnSpec, *, turns: int = 0) -> AgentRecord:
    """The record of an agent about to start in ``directory`` (its id is the dir's name)."""
    now = time.time()
    return AgentRecord(
        id=directory.name,
        name=spec.label or f"agent-{directory.name}",
        status=AgentStatus.SPAWNING,
        started_at=proto.rfc3339(now),
        session_dir=str(directory),
        endpoint=proto.UnixEndpoint(path=str(directory / AGENT_SOCKET_FILE)),
        working_dir=spec.cwd or str(directory),
        spec=spec,
        created_at=now,
        updated_at=now,
        turns=turns,
    )


def _never_saved(ref: ResumeRef, directory: Path) -> bool:
    """Whether the agent of ``ref`` never saved a turn: no session file at all, and no
    turn on record (an agent whose session went missing after it saved turns is lost
    work, and stays in the checkpoint, unclean, saying so)."""
    return ref.session_sha256 is None and not ref.turns and not session_file(directory).exists()
