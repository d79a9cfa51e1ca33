"""``python -m worker_agent.reaper COMMAND...``: run COMMAND as the root of a process tree
that goes as one, as a container's processes go when its init exits.

The stand-in Sandbox controller of ``drainctl dev up`` starts every pod through it, so
that nothing of a pod outlives the pod, however it ends. ``PR_SET_PDEATHSIG`` alone does
not give that: a daemon's agents and consumer run in sessions of their own, an agent
told to stop by its dying daemon may finish its turn first, and one that ignores SIGTERM
(or a worker program that never asked for a death signal) would run on for ever,
writing into a workspace that a restarted stack has handed to a new daemon.

What it keeps true:

- it is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process of the tree whose
  parent exits is re-parented here, not to init, so the whole tree stays below it;
- SIGTERM and SIGINT go to COMMAND (a pod's graceful stop: the daemon drains);
- when COMMAND exits, or on :data:`KILL_TREE` (which its starter sends when a graceful
  stop ran out of time, and which the kernel sends when its starter dies: a lost node,
  with nobody left to wait for), every process left in the tree is SIGKILLed; then it
  exits with COMMAND's code (128 + the signal for a signalled one);
- COMMAND gets SIGKILL if this process itself is SIGKILLed.

Linux only (``prctl``); standard library and ``worker_agent.children`` only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from typing import Final

from worker_agent.children import descendants, die_with_parent, is_zombie

KILL_TREE: Final = signal.SIGHUP
"""The signal that makes the reaper SIGKILL its whole tree at once."""
PR_SET_CHILD_SUBREAPER: Final = 36
_FORWARDED: Final = frozenset({signal.SIGTERM, signal.SIGINT})
_WAITED: Final = frozenset({signal.SIGCHLD, KILL_TREE, *_FORWARDED})
_MAX_KILL_ROUNDS: Final = 200


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _reap(command_pid: int) -> int | None:
    """Collect every exited child; COMMAND's exit code if it was one of them."""
    found = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if pid == 0:
            return found
        if pid == command_pid:
            found = _exit_code(status)


def kill_tree(command_pid: int) -> int | None:
    """SIGKILL every live descendant until none is left (a dying process may fork);
    COMMAND's exit code if it was collected on the way."""
    found = None
    for _ in range(_MAX_KILL_ROUNDS):
        live = [pid for pid in descendants(os.getpid()) if not is_zombie(pid)]
        if not live:
            break
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        code = _reap(command_pid)
        found = code if code is not None else found
        signal.sigtimedwait({signal.SIGCHLD}, 0.01)
    code = _reap(command_pid)
    return code if code is not None else found


def _start(command: list[str]) -> int:
    reaper = os.getpid()

    def in_child() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _WAITED)
        die_with_parent(signal.SIGKILL, reaper)

    # The reaper's own pid is the only state kept: Popen's bookkeeping is not used, since
    # every child (COMMAND and re-parented orphans alike) is collected by waitpid(-1).
    return subprocess.Popen(command, preexec_fn=in_child).pid


def main(argv: list[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("usage: python -m worker_agent.reaper COMMAND [ARG...]", file=sys.stderr)
        return 2
    signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    try:
        command_pid = _start(command)
    except OSError as exc:
        print(f"reaper: cannot start {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 127
    code: int | None = None
    while code is None:
        received = signal.sigwaitinfo(_WAITED)
        if received.si_signo in _FORWARDED:
            with contextlib.suppress(ProcessLookupError):
                os.kill(command_pid, received.si_signo)
        elif received.si_signo == KILL_TREE:
            code = kill_tree(command_pid)
            code = 128 + KILL_TREE if code is None else code
        else:
            code = _reap(command_pid)
    found = kill_tree(command_pid)  # what COMMAND left behind goes with it
    return code if found is None else found


if __name__ == "__main__":
    sys.exit(main())
