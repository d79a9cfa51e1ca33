"""Faults a hostile or unlucky environment inflicts on the daemon, each with the
project's default settings: a second daemon on the same store, a resume racing a drain,
a worker's child that outlives it, an unreadable agent directory, a full disk, and
malformed configuration and input. Each ends with nothing lost and nothing let in.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import DaemonProcess, wait_until
from worker_agent.client import ControlError, SupervisorClient
from worker_agent.proto import AgentStatus
from worker_agent.session import load_session

NOBODY = 65534


def drainctl_daemon(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "daemon", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ one daemon per store


def test_a_second_daemon_on_the_same_store_refuses_and_leaves_the_first_alone(
    daemon: DaemonProcess,
) -> None:
    """Tried: ``drainctl daemon`` started again on a live daemon's store and socket."""
    ids = daemon.spawn_working(2, "turns=100000,turn_ms=20", 1)
    second = drainctl_daemon("--store", str(daemon.store), "--socket", str(daemon.socket))
    assert second.returncode != 0
    assert "in use by another daemon" in second.stderr
    assert "Traceback" not in second.stderr
    # The first daemon still owns its socket, its agents and their manifests.
    records = daemon.records()
    assert all(records[i].status in (AgentStatus.RUNNING, AgentStatus.IDLE) for i in ids)
    for agent_id in ids:
        manifest = json.loads((daemon.store / "agents" / agent_id / "manifest.json").read_text())
        assert manifest["status"] not in ("crashed",), manifest
    with daemon.client() as client:
        refs = client.drain(10)
    assert sorted(r.id for r in refs) == sorted(ids) and all(r.clean for r in refs)


def test_a_daemon_killed_outright_leaves_no_stale_store_lock(tmp_short: Path) -> None:
    """Tried: SIGKILL of a daemon, then a new daemon on its store (a pod restart)."""
    first = DaemonProcess(tmp_short).start()
    first.spawn_working(1, "turns=100000,turn_ms=20", 1)
    first.signal(signal.SIGKILL)
    first.wait()
    second = DaemonProcess(tmp_short).start()
    try:
        records = second.records()
        assert [r.status for r in records.values()] == [AgentStatus.CRASHED]
    finally:
        second.stop()


# ---------------------------------------------------------------- resume racing a drain


def test_a_resume_waiting_for_its_session_never_launches_behind_a_drain(
    daemon: DaemonProcess,
) -> None:
    """Tried: a resume admitted just before a drain (it waits for the previous worker's
    lock), then the drain; the lock is let go while the drain is still running."""
    slow = daemon.spawn_working(1, "turns=100000,turn_ms=1500", 1)[0]
    paused = daemon.spawn_working(1, "turns=100000,turn_ms=20", 1)[0]
    with daemon.client() as client:
        client.call("kill", id=paused)
    session_dir = daemon.store / "agents" / paused
    held = os.open(session_dir / "worker.lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    outcome: dict[str, object] = {}

    def resume() -> None:
        with daemon.client() as client:
            try:
                outcome["reply"] = client.resume(f"agents/{paused}")
            except ControlError as exc:
                outcome["error"] = exc.body.message

    resumer = threading.Thread(target=resume)
    resumer.start()
    time.sleep(0.3)  # the resume is now waiting for the lock

    def drain() -> None:
        with daemon.client() as client:
            client.drain(30)

    drainer = threading.Thread(target=drain)
    drainer.start()
    time.sleep(0.3)  # the drain is waiting for the slow agent's in-flight turn
    fcntl.flock(held, fcntl.LOCK_UN)
    os.close(held)
    resumer.join(30)
    drainer.join(60)
    assert "draining" in str(outcome.get("error")), outcome
    records = daemon.records()
    assert not any(r.status.live for r in records.values()), records
    turns = records[paused].turns
    time.sleep(1.0)
    assert daemon.records()[paused].turns == turns
    assert slow in records


# ------------------------------------------------------- a worker's children die with it

ROGUE_WORKER = """
import os, signal, sys, time
session_dir = sys.argv[sys.argv.index("--session-dir") + 1]
if os.fork() == 0:
    # A tool the agent left running: ignores SIGTERM and keeps rewriting the session.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    n = 0
    while True:
        n += 1
        path = os.path.join(session_dir, "session.json")
        try:
            data = open(path, "rb").read()
        except OSError:
            time.sleep(0.01)
            continue
        tmp = path + ".rogue"
        with open(tmp, "wb") as out:
            out.write(data.rstrip()[:-1] + b', "rogue": %d}' % n if b'"rogue"' not in data
                      else data.replace(b'"rogue": ', b'"rogue": 1'))
        os.replace(tmp, path)
        time.sleep(0.02)
os.execv(sys.executable, [sys.executable, "-m", "worker_agent.worker", *sys.argv[1:]])
"""


def test_a_drain_leaves_nothing_of_the_worker_writing_its_session(tmp_short: Path) -> None:
    """Tried: a worker whose child ignores SIGTERM and keeps rewriting session.json."""
    rogue = tmp_short / "rogue_worker.py"
    rogue.write_text(ROGUE_WORKER)
    template = (
        f"{{python}} {rogue} --session-dir {{session_dir}} --agent-id {{agent_id}} {{resume}}"
    )
    daemon = DaemonProcess(tmp_short, "--worker-command", template).start()
    try:
        agent_id = daemon.spawn_working(1, "turns=100000,turn_ms=20", 2)[0]
        with daemon.client() as client:
            (ref,) = client.drain(10)
        session = daemon.store / ref.session_dir / "session.json"
        assert sha256_of(session) == ref.session_sha256
        time.sleep(0.5)
        assert sha256_of(session) == ref.session_sha256, "something wrote after the drain"
        assert load_session(session.parent).turns == ref.turns
        assert ref.id == agent_id
    finally:
        daemon.stop()


# ------------------------------------------------------------ unreadable agent directory


def start_as_nobody(root: Path) -> subprocess.Popen[bytes]:
    """The daemon as an unprivileged user (root reads every directory whatever its mode).

    It serves the store and socket only: the interpreter may live where that user cannot
    exec it again, so this daemon is not asked to start workers.
    """
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the daemon as an unprivileged user")
    for path in (root, *root.rglob("*")):
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    os.chmod(root, 0o755)
    log = (root / "daemon.log").open("ab")
    proc = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         sys.executable, "-m", "orchestrator.cli", "daemon", "--store", str(root / "store"),
         "--socket", str(root / "ctl.sock")],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HOME": str(root)},
    )  # fmt: skip
    log.close()

    def ready() -> bool:
        if proc.poll() is not None:
            output = (root / "daemon.log").read_text()
            raise AssertionError(f"daemon exited {proc.returncode}: {output}")
        try:
            with SupervisorClient(socket_path=root / "ctl.sock", timeout=5) as client:
                client.status()
        except OSError:
            return False
        return True

    wait_until(ready, 30, "the unprivileged daemon")
    return proc


def test_one_unreadable_agent_directory_does_not_stop_the_daemon_starting(
    tmp_short: Path,
) -> None:
    """Tried: an agent directory its daemon's user cannot read, then a daemon restart."""
    first = DaemonProcess(tmp_short)
    first.socket = tmp_short / "ctl.sock"
    first.start()
    ids = first.spawn_working(2, "turns=100000,turn_ms=20", 1)
    first.stop()
    unreadable = tmp_short / "store" / "agents" / ids[0]
    proc = None
    try:
        unreadable.chmod(0o000)
        proc = start_as_nobody(tmp_short)
        with SupervisorClient(socket_path=tmp_short / "ctl.sock", timeout=30) as client:
            assert [r.id for r in client.agents()] == [ids[1]]
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        unreadable.chmod(0o700)
    assert "manifest_unreadable" in (tmp_short / "daemon.log").read_text()


def test_rm_that_cannot_delete_says_so_and_keeps_the_agent(daemon: DaemonProcess) -> None:
    """Tried: ``rm`` of an agent with an immutable file (``chattr +i``) in its directory."""
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    agent_id = daemon.spawn_working(1, "turns=100000,turn_ms=20", 1)[0]
    with daemon.client() as client:
        client.drain(10)
    pinned = daemon.store / "agents" / agent_id / "stderr.log"
    if subprocess.run(["chattr", "+i", str(pinned)], check=False).returncode != 0:
        pytest.skip("this filesystem does not support the immutable attribute")
    try:
        with daemon.client() as client:
            with pytest.raises(ControlError, match="could not remove"):
                client.call("rm", id=agent_id, force=False)
            assert agent_id in [r.id for r in client.agents()]
    finally:
        subprocess.run(["chattr", "-i", str(pinned)], check=False)


# -------------------------------------------------------------------------- full disk


@contextlib.contextmanager
def small_filesystem(root: Path, size: str = "4m") -> Iterator[Path]:
    mount_point = root / "fs"
    mount_point.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount_point)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(directory: Path) -> None:
    with (directory / "filler").open("wb") as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 65536)
            out.flush()


def test_a_full_disk_still_drains_stops_and_restarts_losing_no_saved_session(
    tmp_short: Path,
) -> None:
    """Tried: the workspace volume filled up while agents run; drain, SIGTERM, restart."""
    with small_filesystem(tmp_short) as fs:
        daemon = DaemonProcess(fs)
        daemon.socket = tmp_short / "ctl.sock"
        daemon.log = tmp_short / "daemon.log"
        daemon.start()
        ids = daemon.spawn_working(2, "turns=100000,turn_ms=20", 2)
        fill(fs)
        with daemon.client() as client:
            refs = client.drain(10)
        assert sorted(r.id for r in refs) == sorted(ids)
        for ref in refs:  # the last good session of each agent is whole and is what the ref says
            session = daemon.store / ref.session_dir / "session.json"
            assert load_session(session.parent).turns == ref.turns >= 2
            assert sha256_of(session) == ref.session_sha256
        with daemon.client() as client:
            client.resume(refs[0].session_dir)
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
        daemon.start()  # a restart on the full disk
        try:
            assert sorted(daemon.records()) == sorted(ids)
        finally:
            daemon.stop()
        assert "Traceback" not in daemon.log.read_text()
        leftovers = [p for p in (fs / "store").rglob("*.tmp")]
        assert leftovers == []


# -------------------------------------------------------- configuration and input limits


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--drain-grace", "inf"], "DRAIN_DAEMON_DRAIN_GRACE_SECS", id="grace-inf"),
        pytest.param(
            ["--drain-grace", "99999"], "DRAIN_DAEMON_DRAIN_GRACE_SECS", id="grace-over-cap"
        ),
        pytest.param(["--listen", "127.0.0.1:99999"], "port", id="listen-port-out-of-range"),
        pytest.param(["--listen", "no-port"], "DRAIN_DAEMON_LISTEN", id="listen-not-host-port"),
    ],
)
def test_bad_daemon_settings_are_refused_before_the_store_is_touched(
    tmp_short: Path, args: list[str], message: str
) -> None:
    """Tried: each bad value; the daemon must exit with one line, creating nothing."""
    store = tmp_short / "store"
    result = drainctl_daemon("--store", str(store), "--socket", str(tmp_short / "s"), *args)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not store.exists()


def test_a_listen_port_in_use_is_one_line_and_leaves_no_socket(tmp_short: Path) -> None:
    """Tried: ``--listen`` on a port another process holds."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    token = tmp_short / "token"
    token.write_text("x" * 32)
    from tests.integration.test_network_transport import write_self_signed

    write_self_signed(tmp_short / "c.pem", tmp_short / "k.pem")
    try:
        result = drainctl_daemon(
            "--store", str(tmp_short / "store"), "--socket", str(tmp_short / "ctl.sock"),
            "--listen", f"127.0.0.1:{port}", "--token-file", str(token),
            "--tls-cert", str(tmp_short / "c.pem"), "--tls-key", str(tmp_short / "k.pem"),
        )  # fmt: skip
    finally:
        taken.close()
    assert result.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_short / "ctl.sock").exists()


def test_deeply_nested_json_is_refused_as_a_bad_request_not_a_crash(
    daemon: DaemonProcess,
) -> None:
    """Tried: 400 KB of ``[`` on the control socket."""
    import socket

    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(daemon.socket))
        sock.sendall(b"[" * 400_000 + b"\n")
        reply = json.loads(sock.makefile("rb").readline())
    assert reply["error"]["kind"] == "internal"  # as caliband answers a malformed line
    assert reply["error"]["message"].startswith("bad request: ")
    assert "nests" in reply["error"]["message"]
    assert "RecursionError" not in daemon.log.read_text()
    with daemon.client() as client:
        client.status()


def test_a_session_claiming_turns_it_never_announced_is_refused(daemon: DaemonProcess) -> None:
    """Tried: session.json edited to ``caliban_drain.turns: 999999`` with no messages,
    then resume."""
    agent_id = daemon.spawn_working(1, "turns=100000,turn_ms=20", 1)[0]
    with daemon.client() as client:
        client.drain(10)
    directory = daemon.store / "agents" / agent_id
    doc = json.loads((directory / "session.json").read_text())
    doc["caliban_drain"]["turns"] = 999_999
    doc["messages"] = []
    (directory / "session.json").write_text(json.dumps(doc))
    transcript_size = (directory / "stdout.ndjson").stat().st_size
    with daemon.client() as client, pytest.raises(ControlError, match="announces"):
        client.resume(f"agents/{agent_id}")
    assert (directory / "stdout.ndjson").stat().st_size == transcript_size


# ---------------------------------------------------------------------------- orphans


def test_a_daemon_killed_outright_takes_its_consumer_and_workers_with_it(
    tmp_short: Path,
) -> None:
    """Tried: SIGKILL of a daemon that runs a Celery consumer child and agents."""
    import psutil

    from tests.pipeline_support import Stack, consumer_pid, fresh_sqlite, redis_db_url

    stack = Stack(tmp_short, redis_db_url(db=13), fresh_sqlite(tmp_short))
    try:
        daemon = stack.start_daemon("team-a", "orphans")
        daemon.spawn_working(2, "turns=100000,turn_ms=20", 1)
        consumer = wait_until(lambda: consumer_pid(daemon), 30, "the daemon's consumer")
        assert daemon.proc is not None
        workers = [c.pid for c in psutil.Process(daemon.proc.pid).children() if c.pid != consumer]
        daemon.signal(signal.SIGKILL)
        daemon.wait()

        def gone(pid: int) -> bool:
            try:
                return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        wait_until(lambda: all(gone(p) for p in [consumer, *workers]), 30, "no orphan left")
    finally:
        stack.close()


# ------------------------------------------------------- resuming only to a ready pod


def test_a_resume_that_reaches_a_stopping_daemon_is_served_by_the_next_one_on_its_store(
    tmp_short: Path,
) -> None:
    """Tried: a resume delivered while the pod's daemon shuts down, as a wake right after
    a pause is: the daemon has its SIGTERM (an agent that ignores it keeps it stopping)
    and answers every resume "the daemon is stopping". Its consumer must hand the
    message back, and the next daemon on the store resume exactly the checkpoint's
    agents. The consumer runs alone here, so it keeps consuming while its daemon stops
    (in a pod it is the daemon's child and stops with it: the race this closes)."""
    import psutil

    from orchestrator.ledger import OperationState, OperationView
    from tests.pipeline_support import Stack, fresh_sqlite, redis_db_url

    stack = Stack(tmp_short, redis_db_url(db=8), fresh_sqlite(tmp_short))
    consumer: subprocess.Popen[bytes] | None = None
    try:
        stack.start_worker()
        home = tmp_short / "team-a.stopping"
        home.mkdir()
        first = DaemonProcess(home, env=stack.env).start()
        stack.daemons.append(first)
        log = (home / "consumer.log").open("wb")
        consumer = subprocess.Popen(
            [sys.executable, "-m", "worker_agent.consumer", "--queue",
             "caliband.team-a.stopping", "--socket", str(first.socket), "--store",
             str(first.store)],
            stdout=log, stderr=subprocess.STDOUT, env=stack.full_env(),
        )  # fmt: skip
        (kept,) = first.spawn_working(1, "turns=100000,turn_ms=50", 2)
        drained = stack.drainctl("drain", "team-a/stopping", "--wait", "--timeout", "90")
        assert drained.returncode == 0, drained.stderr
        ref = drained.stdout.strip()
        (stubborn,) = first.spawn_working(1, "turns=100000,turn_ms=50,sigterm=ignore", 1)
        stubborn_dir = first.store / first.records()[stubborn].session_dir
        assert first.proc is not None
        (stubborn_worker,) = [
            child for child in psutil.Process(first.proc.pid).children(recursive=True)
            if Path(child.cwd()) == stubborn_dir
        ]  # fmt: skip

        first.signal(signal.SIGTERM)
        wait_until(lambda: "daemon_stopping" in first.log_text(), 30, "the daemon to stop")
        resumed = stack.drainctl("resume", "team-a/stopping", "--checkpoint", ref, "--json")
        assert resumed.returncode == 0, resumed.stderr
        op_id = json.loads(resumed.stdout)["id"]
        consumer_log = home / "consumer.log"

        def handed_back_or_answered() -> bool:
            op = stack.ledger.get_operation(op_id)
            return "resume_handed_back" in consumer_log.read_text() or bool(op and op.terminal)

        wait_until(handed_back_or_answered, 60, "the consumer to hand the resume back")
        op = stack.ledger.get_operation(op_id)
        assert op is not None and op.state is OperationState.RESUMING, (
            op,
            consumer_log.read_text()[-2000:],
        )

        # The pod goes: its consumer with it, its stubborn agent killed at the grace.
        consumer.kill()
        consumer.wait(30)
        stubborn_worker.kill()
        first.wait(60)
        second = stack.start_daemon("team-a", "stopping")
        assert second.store == first.store

        def finished() -> OperationView | None:
            op = stack.ledger.get_operation(op_id)
            return op if op is not None and op.terminal else None

        done = wait_until(finished, 90, "the resume to finish on the next daemon")
        assert done.state is OperationState.RESUMED, done.error
        assert [r["id"] for r in (done.detail or {})["results"]] == [kept]
        records = second.records()
        assert records[kept].status.live
        assert not records[stubborn].status.live  # not the checkpoint's: left as it is
    finally:
        if consumer is not None and consumer.poll() is None:
            consumer.kill()
        stack.close()


# ------------------------------------------------------- resuming an older checkpoint


def test_resume_of_an_older_checkpoint_is_refused_once_the_workspace_moved_on(
    daemon: DaemonProcess,
) -> None:
    """Tried: drain (checkpoint 1), resume, more turns, drain (checkpoint 2), then a
    resume that expects checkpoint 1's session."""
    agent_id = daemon.spawn_working(1, "turns=100000,turn_ms=20", 1)[0]
    with daemon.client() as client:
        (older,) = client.drain(10)
        client.resume(
            older.session_dir, expect_turns=older.turns, expect_sha256=older.session_sha256
        )
    wait_until(lambda: daemon.records()[agent_id].turns > older.turns + 1, 30, "new turns")
    with daemon.client() as client:
        (newer,) = client.drain(10)
        with pytest.raises(ControlError, match="has moved on since"):
            client.resume(
                older.session_dir, expect_turns=older.turns, expect_sha256=older.session_sha256
            )
        assert not daemon.records()[agent_id].status.live
        client.resume(
            newer.session_dir, expect_turns=newer.turns, expect_sha256=newer.session_sha256
        )
    assert daemon.records()[agent_id].status.live


# ----------------------------------------------------------------------------- limits


def test_spawns_past_the_agent_limit_are_refused(tmp_short: Path) -> None:
    """Tried: a third spawn on a daemon whose limit is two agents."""
    daemon = DaemonProcess(tmp_short, env={"DRAIN_DAEMON_MAX_AGENTS": "2"}).start()
    try:
        with daemon.client() as client:
            for _ in range(2):
                client.spawn(provider="scripted", model="turns=100000,turn_ms=20")
            with pytest.raises(ControlError, match="limit"):
                client.spawn(provider="scripted", model="turns=100000,turn_ms=20")
            assert len(client.agents()) == 2
    finally:
        daemon.stop()


def test_an_oversized_session_is_reported_unclean_and_refused_on_resume(
    daemon: DaemonProcess,
) -> None:
    """Tried: session.json grown (sparse) past the size the daemon reads."""
    from worker_agent.session import MAX_SESSION_BYTES

    agent_id = daemon.spawn_working(1, "turns=100000,turn_ms=20", 1)[0]
    with daemon.client() as client:
        client.drain(10)
    session = daemon.store / "agents" / agent_id / "session.json"
    with session.open("r+b") as fh:
        fh.truncate(MAX_SESSION_BYTES + 1)
    with daemon.client() as client:
        (ref,) = client.drain(10)
        assert not ref.clean and "limit" in (ref.error or "")
        with pytest.raises(ControlError, match="at most"):
            client.resume(ref.session_dir)
