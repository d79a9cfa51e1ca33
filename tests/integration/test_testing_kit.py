"""The testing kit leaves nothing running: a stopped daemon takes its agents with it, a
child that ignores SIGTERM is SIGKILLed with its process group after the grace, and a
program that forgets to stop its daemon still leaves none behind when it exits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from worker_agent.children import descendants
from worker_agent.testing import DaemonProcess, Subprocess, wait_until


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_stopping_a_daemon_leaves_none_of_its_agents_running(tmp_short: Path) -> None:
    daemon = DaemonProcess(tmp_short).start()
    daemon.spawn_working(2, "turns=100000,turn_ms=50", 1)
    tree = [daemon.pid, *descendants(daemon.pid)]
    assert len(tree) >= 3
    daemon.stop(60)
    assert [pid for pid in tree if alive(pid)] == []


def test_a_child_that_ignores_sigterm_is_killed_with_its_group_after_the_grace(
    tmp_short: Path,
) -> None:
    script = textwrap.dedent(
        """
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        print(child.pid, flush=True)
        time.sleep(600)
        """
    )
    stubborn = Subprocess([sys.executable, "-c", script], tmp_short / "stubborn.log", os.environ)
    stubborn.launch()
    grandchild = wait_until(lambda: stubborn.log_text().strip(), 30, "the grandchild's pid")
    assert stubborn.stop(grace=0.5) >= 1
    assert not alive(stubborn.pid)
    wait_until(lambda: not alive(int(grandchild)), 10, "the grandchild to be killed")


def test_a_program_that_never_stops_its_daemon_leaves_no_daemon_behind(tmp_short: Path) -> None:
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from worker_agent.children import descendants
        from worker_agent.testing import DaemonProcess
        daemon = DaemonProcess(Path({str(tmp_short)!r})).start()
        daemon.spawn_working(1, "turns=100000,turn_ms=50", 1)
        print(" ".join(map(str, [daemon.pid, *descendants(daemon.pid)])), flush=True)
        raise SystemExit("crashed without stopping the daemon")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 1, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) >= 2
    wait_until(lambda: not any(alive(p) for p in pids), 10, "every process to be gone")
