"""Unix socket paths of any length.

A socket's address (``sun_path``) holds at most 107 bytes, and an agent's attach endpoint
lives in its session dir, which on a deep volume path (the dev stack's, a test's temp
dir) is longer than that. A path that does not fit is reached through its directory's
descriptor instead, ``/proc/self/fd/N/<name>``: Linux resolves the descriptor's link as
the directory itself, so the socket file is created, and found, where the path says.
Standard library only: the reference worker imports it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

MAX_ADDRESS = 107
"""Bytes of ``sun_path`` available to a path (108 with its terminating NUL)."""


@contextlib.contextmanager
def address(path: str | Path) -> Iterator[str]:
    """An address that reaches ``path`` for as long as the block runs: the path itself
    when it fits, else through a descriptor of its directory."""
    text = os.fspath(path)
    if len(os.fsencode(text)) <= MAX_ADDRESS:
        yield text
        return
    directory, name = os.path.split(text)
    fd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


def bound(path: str | Path) -> socket.socket:
    """A new stream socket bound at ``path`` (not listening yet)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with address(path) as where:
            sock.bind(where)
    except BaseException:
        sock.close()
        raise
    return sock


def connect(sock: socket.socket, path: str | Path) -> None:
    """Connect ``sock`` (AF_UNIX) to the socket at ``path``."""
    with address(path) as where:
        sock.connect(where)


def connected(path: str | Path) -> socket.socket:
    """A new stream socket connected to the socket at ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connect(sock, path)
    except BaseException:
        sock.close()
        raise
    return sock
