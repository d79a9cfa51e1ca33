"""``drainctl demo --daemon-only``: the daemon story, end to end, with nothing installed.

It starts a real supervisor daemon as a subprocess (through the testing kit,
``worker_agent.testing``), spawns scripted agents, drains them in the middle of their
turns, shows the resume references, kills the daemon outright (as a node failure
would), restarts it, resumes every agent from its checkpoint and
shows each conversation carrying on from ``turns + 1``. Every number it prints is read
back from the files on disk, so the demo is also a check: it exits non-zero if any
completed turn went missing.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from worker_agent.proto import AgentStatus, ResumeRef
from worker_agent.session import count_completed_turns, load_session
from worker_agent.testing import DaemonProcess, ProcessExited, WaitTimeout, wait_until

Echo = Callable[[str], None]


class DemoFailure(Exception):
    """A step of the story did not happen as it should; the message says which."""


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    try:
        wait_until(condition, timeout, what, interval=0.05)
    except WaitTimeout as exc:
        raise DemoFailure(str(exc)) from None


@contextlib.contextmanager
def _daemon(root: Path) -> Iterator[DaemonProcess]:
    """A daemon of the testing kit in ``root``; stopped (SIGTERM, then SIGKILL) on exit."""
    daemon = DaemonProcess(root, drain_grace=10)
    try:
        daemon.start()
    except (WaitTimeout, ProcessExited):
        daemon.stop(10)
        raise DemoFailure(f"the daemon did not start; see {daemon.log}") from None
    try:
        yield daemon
    finally:
        daemon.stop(60)


def _show_refs(echo: Echo, refs: list[ResumeRef]) -> None:
    for ref in refs:
        echo(
            f"    {ref.id}  turns={ref.turns:<3} clean={ref.clean!s:<5} "
            f"sha256={(ref.session_sha256 or '-')[:12]}  {ref.session_dir}"
        )


def _check_on_disk(store: Path, refs: list[ResumeRef]) -> None:
    for ref in refs:
        directory = store / ref.session_dir
        session = load_session(directory)
        announced = count_completed_turns(directory)
        if not (ref.turns == session.turns == announced) or ref.session_sha256 != session.sha256:
            raise DemoFailure(
                f"{ref.id}: ref says {ref.turns} turns, session.json {session.turns}, "
                f"transcript {announced}"
            )


def run_demo(*, agent_count: int, state_dir: Path | None, echo: Echo) -> int:
    root = state_dir or Path(tempfile.mkdtemp(prefix="caliban-demo-", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    store = root / "store"
    log = root / "daemon.log"
    try:
        echo(f"caliban-drain demo — state in {root} (daemon log: {log})\n")
        with _daemon(root) as daemon:
            echo(f"1. daemon up (pid {daemon.pid}); spawning {agent_count} scripted agents")
            with daemon.client() as client:
                ids = [
                    client.spawn(provider="scripted", model="turns=40,turn_ms=150").id
                    for _ in range(agent_count)
                ]
                _wait(lambda: all(r.turns >= 3 for r in client.agents()), 60, "agents to do turns")
                echo("2. agents are mid-conversation:")
                for record in client.agents():
                    echo(f"    {record.id}  {record.status.value:<8} turns={record.turns}")
                echo("3. drain (SIGTERM, grace 10s, flush, verify):")
                started = time.monotonic()
                refs = client.drain(grace_secs=10)
                echo(f"   drained {len(refs)} agents in {time.monotonic() - started:.2f}s")
                _show_refs(echo, refs)
                _check_on_disk(store, refs)
                echo("   every ref matches session.json and the transcript on disk")
                echo("4. resume them all, let them work, then kill the daemon with SIGKILL")
                for ref in refs:
                    client.resume(ref.session_dir)
                before = {ref.id: ref.turns for ref in refs}
                _wait(
                    lambda: all(r.turns >= before[r.id] + 2 for r in client.agents()),
                    60,
                    "resumed agents to do more turns",
                )
            daemon.signal(signal.SIGKILL)
            daemon.wait(10)
        with _daemon(root) as daemon, daemon.client() as client:
            records = client.agents()
            echo(f"5. daemon restarted (pid {daemon.pid}); its agents came back as:")
            for record in records:
                echo(f"    {record.id}  {record.status.value}")
            if any(r.status is not AgentStatus.CRASHED for r in records):
                raise DemoFailure("formerly live agents should be listed as crashed")
            refs = client.drain(grace_secs=10)
            _check_on_disk(store, refs)
            echo("6. their checkpoints survived the crash:")
            _show_refs(echo, refs)
            for ref in refs:
                client.resume(ref.session_dir)
            saved = {ref.id: ref.turns for ref in refs}
            _wait(
                lambda: all(r.turns > saved[r.id] for r in client.agents()),
                60,
                "agents to continue",
            )
            final = client.drain(grace_secs=10)
            _check_on_disk(store, final)
            echo("7. resumed at turns + 1 and drained again:")
            for ref in final:
                echo(f"    {ref.id}  {saved[ref.id]} -> {ref.turns} turns")
        if set(ids) != {ref.id for ref in final}:
            raise DemoFailure("an agent went missing")
        echo("\nno completed turn was lost.")
        return 0
    except DemoFailure as exc:
        echo(f"demo failed: {exc}")
        return 1
    finally:
        if state_dir is None:
            shutil.rmtree(root, ignore_errors=True)
