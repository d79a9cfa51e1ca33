"""Drain benchmark: the daemon's drain time against the floor of N bare processes.

Run as ``.venv/bin/python bench/drain.py [--repeat R] [--sizes 1,10,100] [--write]``.

For each N and each of R repetitions, in one run on one machine:

* **daemon**: a real ``drainctl daemon`` subprocess, N scripted agents spawned with a
  long script (so they are mid-turn when drained), waited on until every one reports
  ``running``/``idle`` with at least one completed turn; then ``drain(grace_secs=30)``
  is timed wall-clock from request to reply. Every ``ResumeRef`` is checked: clean,
  exit 0, its turns equal to ``session.json``'s and to the ``turn_complete`` events in
  the transcript, its sha256 equal to the file's. A lost turn aborts the bench (exit 2).
* **floor**: N bare Python processes (same interpreter) that hold a small conversation
  in memory and, on SIGTERM, write it atomically and durably (temp file, fsync, rename,
  fsync dir: the worker's save) and exit 0. Timed from the first SIGTERM until all of
  them are reaped.

The medians give ``ratio = daemon / floor`` per N. Budgets: ratio <= 1.3 at the
largest N, daemon growth with N no faster than the floor's, daemon RSS < 80 MB with
the largest N agents registered. Exit 0 when every budget is met, 1 when one is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import psutil

from worker_agent.client import SupervisorClient
from worker_agent.proto import AgentRecord, AgentStatus, ResumeRef
from worker_agent.session import SESSION_FILE, TRANSCRIPT_FILE, count_completed_turns

T = TypeVar("T")

RATIO_BUDGET = 1.3
RSS_BUDGET_MB = 80.0
DEFAULT_MODEL = "turns=100000,turn_ms=50"
DRAIN_GRACE_SECS = 30.0
FLOOR_TURNS = 10
"""Turns of conversation each floor process holds (about the size a worker holds)."""
RESULTS_FILE = Path(__file__).resolve().parent / "RESULTS.md"
BEGIN_MARK = "<!-- bench/drain.py results: begin -->"
END_MARK = "<!-- bench/drain.py results: end -->"

FLOOR_SCRIPT = r"""
import json, os, signal, sys

directory, turns = sys.argv[1], int(sys.argv[2])
messages = []
for turn in range(1, turns + 1):
    prompt = f"scripted prompt {turn}"
    messages.append({"role": "user", "content": prompt, "turn": turn})
    reply = f"scripted reply to {prompt!r} after {2 * turn - 1} messages (0123456789ab)"
    messages.append({"role": "assistant", "content": reply, "turn": turn})
session = {
    "version": 1,
    "agent_id": os.path.basename(directory),
    "turns": turns,
    "messages": messages,
}


def save():
    raw = json.dumps(session, separators=(",", ":")).encode()
    path = os.path.join(directory, "session.json")
    tmp = os.path.join(directory, f".session.json.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def on_term(signum, frame):
    save()
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
sys.stdout.write("ready\n")
sys.stdout.flush()
while True:
    signal.pause()
"""


class BenchFailure(Exception):
    """A correctness check failed (a lost turn, an unclean ref, a daemon that died)."""


# ----------------------------------------------------------------------------- helpers


def wait_until(
    condition: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchFailure(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def short_tmp(prefix: str) -> Iterator[Path]:
    """A temp dir with a short path: Unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.sync()  # so this run's writeback does not land in the next run's timing


def proc_status_kb(pid: int, key: str) -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise BenchFailure(f"/proc/{pid}/status has no {key}")


def kill_all(procs: Sequence[psutil.Process]) -> int:
    """SIGKILL every process still alive; return how many were. psutil checks the
    process's start time, so a pid recycled by an unrelated process is never signalled."""
    alive = 0
    for proc in procs:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            proc.kill()
            alive += 1
        except psutil.NoSuchProcess:
            continue
    return alive


# ------------------------------------------------------------------------------- floor


@dataclass
class FloorRun:
    n: int
    secs: float


def measure_floor(n: int) -> FloorRun:
    procs: list[subprocess.Popen[bytes]] = []
    with short_tmp("cdf-") as root:
        try:
            dirs = []
            for i in range(n):
                directory = root / f"a{i}"
                directory.mkdir(mode=0o700)
                dirs.append(directory)
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", FLOOR_SCRIPT, str(directory), str(FLOOR_TURNS)],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                    )
                )
            deadline = time.monotonic() + 60
            for proc in procs:
                assert proc.stdout is not None
                ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
                if not ready or proc.stdout.readline() != b"ready\n":
                    raise BenchFailure(f"floor process {proc.pid} never became ready")
            started = time.perf_counter()
            for proc in procs:
                os.kill(proc.pid, signal.SIGTERM)
            for proc in procs:
                proc.wait()
            secs = time.perf_counter() - started
            for proc, directory in zip(procs, dirs, strict=True):
                if proc.returncode != 0:
                    raise BenchFailure(f"floor process {proc.pid} exited {proc.returncode}")
                doc = json.loads((directory / SESSION_FILE).read_bytes())
                if doc.get("turns") != FLOOR_TURNS:
                    raise BenchFailure(f"floor session {directory} holds {doc.get('turns')!r}")
            return FloorRun(n, secs)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
                if proc.stdout is not None:
                    proc.stdout.close()


# ------------------------------------------------------------------------------ daemon


@dataclass
class DaemonRun:
    n: int
    secs: float
    """Wall-clock drain, request to reply, seen by the client."""
    daemon_secs: float | None
    """The daemon's own ``drained ... secs=`` figure, from its log."""
    workers_stopped_secs: float
    """From the request until the last worker wrote its final ``stopped`` event."""
    rss_kb: int
    hwm_kb: int
    turns: int
    """Completed turns over all agents at the drain."""
    abandoned: int
    """In-flight turns abandoned (re-run on resume) rather than finished."""


def daemon_env() -> dict[str, str]:
    """The environment without ``DRAIN_DAEMON_*``: the bench's options are the only ones."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAIN_DAEMON_")}
    return {**env, "PYTHONUNBUFFERED": "1"}


class Daemon:
    """``drainctl daemon`` as a subprocess; ``stop`` never leaves it (or workers) behind."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = root / "store"
        self.socket = root / "ctl.sock"
        self.log = root / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.workers: dict[int, psutil.Process] = {}

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "orchestrator.cli", "daemon",
                    "--store", str(self.store), "--socket", str(self.socket),
                    "--drain-grace", str(DRAIN_GRACE_SECS),
                ],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=daemon_env(),
            )  # fmt: skip
        wait_until(self._ready, 30, f"daemon socket {self.socket}")

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise BenchFailure(f"daemon exited {self.proc.returncode}:\n{self.log_tail()}")
        if not self.socket.exists():
            return False
        try:
            with self.client() as client:
                client.status()
        except OSError:
            return False
        return True

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self) -> SupervisorClient:
        return SupervisorClient(socket_path=self.socket, timeout=120.0)

    def note_workers(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(self.pid).children():
                self.workers.setdefault(child.pid, child)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no daemon log)"

    def drained_secs(self) -> float | None:
        for line in reversed(self.log.read_text(errors="replace").splitlines()):
            if "event=drained " in line and " secs=" in line:
                return float(line.rsplit(" secs=", 1)[1].split()[0])
        return None

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(psutil.NoSuchProcess):
            self.note_workers()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        leaked = kill_all(list(self.workers.values()))
        if leaked:
            print(f"warning: killed {leaked} worker(s) left behind by the daemon", file=sys.stderr)


def all_mid_turn(daemon: Daemon, ids: list[str]) -> dict[str, AgentRecord] | None:
    with daemon.client() as client:
        records = {r.id: r for r in client.agents()}
    for agent_id in ids:
        record = records[agent_id]
        if not record.status.live:
            raise BenchFailure(f"agent {agent_id} is {record.status} before the drain: {record}")
        if record.status not in (AgentStatus.RUNNING, AgentStatus.IDLE) or record.turns < 1:
            return None
    return records


def transcript_events(session_dir: Path) -> list[dict[str, object]]:
    events = []
    with (session_dir / TRANSCRIPT_FILE).open("rb") as fh:
        for line in fh:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    events.append(event)
    return events


def verify_refs(
    daemon: Daemon, ids: list[str], before: dict[str, AgentRecord], refs: list[ResumeRef]
) -> tuple[int, int, float]:
    """Fail loudly unless every agent is drained clean with no lost turn.

    Returns (total turns, abandoned in-flight turns, latest ``stopped`` event time).
    """
    by_id = {r.id: r for r in refs}
    if sorted(by_id) != sorted(ids) or len(refs) != len(ids):
        raise BenchFailure(f"drain answered {len(refs)} refs for {len(ids)} agents")
    with daemon.client() as client:
        after = {r.id: r for r in client.agents()}
    total = abandoned = 0
    last_stop = 0.0
    for agent_id in ids:
        ref = by_id[agent_id]
        where = f"agent {agent_id}"
        if not ref.clean or ref.exit != 0 or ref.error is not None:
            raise BenchFailure(f"{where}: unclean ref {ref}")
        directory = daemon.store / ref.session_dir
        raw = (directory / SESSION_FILE).read_bytes()
        doc = json.loads(raw)
        if ref.turns != doc["turns"]:
            raise BenchFailure(f"{where}: ref has {ref.turns} turns, session.json {doc['turns']}")
        if ref.session_sha256 != hashlib.sha256(raw).hexdigest():
            raise BenchFailure(f"{where}: ref sha256 does not match session.json")
        if len(doc["messages"]) != 2 * ref.turns:
            raise BenchFailure(f"{where}: {len(doc['messages'])} messages for {ref.turns} turns")
        announced = count_completed_turns(directory)
        if announced != ref.turns:
            raise BenchFailure(
                f"{where}: transcript has {announced} turn_complete, ref {ref.turns}"
            )
        if ref.turns < before[agent_id].turns:
            raise BenchFailure(
                f"{where}: {ref.turns} turns after the drain, {before[agent_id].turns} before"
            )
        record = after[agent_id]
        if record.status is not AgentStatus.DRAINED or record.turns != ref.turns:
            raise BenchFailure(f"{where}: record after the drain is {record}")
        events = transcript_events(directory)
        abandoned += sum(e.get("type") == "turn_abandoned" for e in events)
        stops = [e for e in events if e.get("type") == "stopped"]
        if len(stops) != 1 or stops[0].get("turns") != ref.turns:
            raise BenchFailure(f"{where}: transcript 'stopped' events {stops}")
        stamp = stops[0].get("ts")
        if not isinstance(stamp, int | float):
            raise BenchFailure(f"{where}: 'stopped' event without a timestamp: {stops[0]}")
        last_stop = max(last_stop, float(stamp))
        total += ref.turns
    return total, abandoned, last_stop


def measure_daemon(n: int, model: str, grace: float = DRAIN_GRACE_SECS) -> DaemonRun:
    with short_tmp("cdd-") as root:
        daemon = Daemon(root)
        try:
            daemon.start()
            with daemon.client() as client:
                ids = [client.spawn(provider="scripted", model=model).id for _ in range(n)]
            daemon.note_workers()
            before = wait_until(
                lambda: all_mid_turn(daemon, ids), 180, f"{n} agents mid-turn", interval=0.25
            )
            daemon.note_workers()
            rss_kb = proc_status_kb(daemon.pid, "VmRSS")
            with daemon.client() as client:
                wall_start = time.time()
                started = time.perf_counter()
                refs = client.drain(grace_secs=grace)
                secs = time.perf_counter() - started
            hwm_kb = proc_status_kb(daemon.pid, "VmHWM")
            turns, abandoned, last_stop = verify_refs(daemon, ids, before, refs)
            return DaemonRun(
                n=n,
                secs=secs,
                daemon_secs=daemon.drained_secs(),
                workers_stopped_secs=last_stop - wall_start,
                rss_kb=rss_kb,
                hwm_kb=hwm_kb,
                turns=turns,
                abandoned=abandoned,
            )
        except BenchFailure as exc:
            raise BenchFailure(
                f"N={n}: {exc}\n--- daemon log tail ---\n{daemon.log_tail()}"
            ) from None
        finally:
            daemon.stop()


# ----------------------------------------------------------------------------- report


@dataclass
class Summary:
    n: int
    daemon: float
    floor: float
    daemon_internal: float | None
    workers_stopped: float
    rss_mb: float
    hwm_mb: float
    daemon_runs: list[float] = field(default_factory=list)
    floor_runs: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.daemon / self.floor


def summarise(n: int, daemon_runs: list[DaemonRun], floor_runs: list[FloorRun]) -> Summary:
    internal = [r.daemon_secs for r in daemon_runs if r.daemon_secs is not None]
    return Summary(
        n=n,
        daemon=statistics.median(r.secs for r in daemon_runs),
        floor=statistics.median(r.secs for r in floor_runs),
        daemon_internal=statistics.median(internal) if internal else None,
        workers_stopped=statistics.median(r.workers_stopped_secs for r in daemon_runs),
        rss_mb=max(r.rss_kb for r in daemon_runs) / 1024,
        hwm_mb=max(r.hwm_kb for r in daemon_runs) / 1024,
        daemon_runs=[r.secs for r in daemon_runs],
        floor_runs=[r.secs for r in floor_runs],
    )


def ms(secs: float | None) -> str:
    return "-" if secs is None else f"{secs * 1000:.0f}"


def table(summaries: list[Summary]) -> str:
    rows = [
        "| N | daemon drain ms (median) | floor ms (median) | ratio | daemon-internal ms "
        "| last worker stopped ms | daemon RSS MB (max) | daemon peak RSS MB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        rows.append(
            f"| {s.n} | {ms(s.daemon)} | {ms(s.floor)} | {s.ratio:.2f} | "
            f"{ms(s.daemon_internal)} | {ms(s.workers_stopped)} | {s.rss_mb:.1f} | "
            f"{s.hwm_mb:.1f} |"
        )
    return "\n".join(rows)


def raw_runs(summaries: list[Summary]) -> str:
    lines = []
    for s in summaries:
        daemon = ", ".join(ms(x) for x in s.daemon_runs)
        floor = ", ".join(ms(x) for x in s.floor_runs)
        lines.append(f"- N={s.n}: daemon [{daemon}] ms; floor [{floor}] ms")
    return "\n".join(lines)


@dataclass
class Verdict:
    name: str
    ok: bool
    detail: str


def verdicts(summaries: list[Summary]) -> list[Verdict]:
    small, large = summaries[0], summaries[-1]
    out = [
        Verdict(
            f"ratio <= {RATIO_BUDGET} at N={large.n}",
            large.ratio <= RATIO_BUDGET,
            f"{large.ratio:.2f}",
        ),
        Verdict(
            f"daemon RSS < {RSS_BUDGET_MB:.0f} MB with {large.n} agents",
            large.rss_mb < RSS_BUDGET_MB,
            f"{large.rss_mb:.1f} MB (peak during the drain {large.hwm_mb:.1f} MB)",
        ),
    ]
    if large.n != small.n:
        daemon_growth = large.daemon / small.daemon
        floor_growth = large.floor / small.floor
        out.append(
            Verdict(
                f"daemon growth N={small.n}->{large.n} no faster than the floor's",
                daemon_growth <= floor_growth,
                f"daemon x{daemon_growth:.1f}, floor x{floor_growth:.1f}",
            )
        )
    return out


def machine() -> str:
    load = os.getloadavg()[0]
    return (
        f"nproc {os.cpu_count()}, Python {platform.python_version()} "
        f"({platform.python_implementation()}), {platform.system()} {platform.release()}, "
        f"/tmp on {filesystem_of(Path('/tmp'))}, 1-min load {load:.2f} at the start"
    )


def filesystem_of(path: Path) -> str:
    best, kind = "", "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind


def report(
    summaries: list[Summary],
    checks: list[Verdict],
    command: str,
    host: str,
    model: str,
    grace: float,
    repeat: int,
) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## Results",
        "",
        f"- Command: `{command}`",
        f"- Date: {when}",
        f"- Machine: {host}",
        f"- Workload: scripted agents `model={model!r}`, drained with "
        f"`grace_secs={grace:g}`; floor processes hold {FLOOR_TURNS} turns; "
        f"medians of {repeat} repetitions",
        "",
        table(summaries),
        "",
        "Budgets:",
        "",
    ]
    for check in checks:
        lines.append(f"- {'PASS' if check.ok else 'FAIL'}: {check.name} ({check.detail})")
    lines += ["", "Every run (wall-clock ms):", "", raw_runs(summaries)]
    return "\n".join(lines)


RESULTS_HEADER = """# Drain benchmark

`bench/drain.py` times `drain(grace_secs=30)` on a real daemon with N scripted agents
mid-turn, and the floor for the same N: N bare Python processes that, on SIGTERM,
write a session file atomically and durably (temp, fsync, rename, fsync dir) and exit 0.
`ratio` = median daemon drain / median floor. Every drain is checked for lost turns
(ref turns == `session.json` turns == `turn_complete` events, sha256 matches).

Columns: *daemon-internal* is the daemon's own `drained ... secs=` log figure;
*last worker stopped* is the time from the request until the last worker wrote its
final `stopped` event (its session is saved; interpreter exit and the daemon's
bookkeeping come after).
"""


def write_results(section: str) -> None:
    block = f"{BEGIN_MARK}\n{section}\n{END_MARK}\n"
    text = RESULTS_FILE.read_text() if RESULTS_FILE.exists() else RESULTS_HEADER
    if BEGIN_MARK in text and END_MARK in text:
        head, _, rest = text.partition(BEGIN_MARK)
        _, _, tail = rest.partition(END_MARK)
        rest_text = tail.lstrip("\n")
        text = head + block + ("\n" + rest_text if rest_text else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    RESULTS_FILE.write_text(text)


# -------------------------------------------------------------------------------- main


def parse_sizes(raw: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in raw.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes {raw!r}: use e.g. 1,10,100") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"--sizes {raw!r}: sizes must be >= 1")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/drain.py", description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="repetitions per N (median)")
    parser.add_argument("--sizes", type=parse_sizes, default=[1, 10, 100], help="e.g. 1,10,100")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="scripted agents' model spec")
    parser.add_argument(
        "--grace", type=float, default=DRAIN_GRACE_SECS, help="drain grace_secs (default 30)"
    )
    parser.add_argument("--write", action="store_true", help=f"update {RESULTS_FILE.name}")
    args = parser.parse_args(argv)
    sizes: list[int] = args.sizes
    repeat: int = max(1, args.repeat)
    command = " ".join([".venv/bin/python", "bench/drain.py", *sys.argv[1:]])
    host = machine()
    print(f"# drain bench: sizes {sizes}, {repeat} repetitions, {host}", flush=True)

    daemon_runs: dict[int, list[DaemonRun]] = {n: [] for n in sizes}
    floor_runs: dict[int, list[FloorRun]] = {n: [] for n in sizes}
    began = time.monotonic()
    try:
        for rep in range(1, repeat + 1):
            for n in sizes:
                floor = measure_floor(n)
                run = measure_daemon(n, args.model, args.grace)
                floor_runs[n].append(floor)
                daemon_runs[n].append(run)
                print(
                    f"rep {rep}/{repeat} N={n:<4} floor {ms(floor.secs):>5} ms  "
                    f"daemon {ms(run.secs):>5} ms (internal {ms(run.daemon_secs)}, "
                    f"workers stopped {ms(run.workers_stopped_secs)})  "
                    f"ratio {run.secs / floor.secs:5.2f}  RSS {run.rss_kb / 1024:.1f} MB  "
                    f"turns {run.turns} abandoned {run.abandoned}",
                    flush=True,
                )
    except BenchFailure as exc:
        print(f"\nBENCH FAILED (correctness): {exc}", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        print("\nBENCH FAILED (error above)", file=sys.stderr)
        return 2

    summaries = [summarise(n, daemon_runs[n], floor_runs[n]) for n in sizes]
    checks = verdicts(summaries)
    section = report(summaries, checks, command, host, args.model, args.grace, repeat)
    print()
    print(section)
    print(f"\n(total {time.monotonic() - began:.0f}s)")
    if args.write:
        write_results(section)
        print(f"wrote {RESULTS_FILE}")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
