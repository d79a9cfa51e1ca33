"""Test helpers: the daemon half of the testing kit (``worker_agent.testing``) under the
names the tests import."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from worker_agent.session import message_text
from worker_agent.testing import DaemonProcess, short_tmp, wait_until

__all__ = ["DaemonProcess", "short_tmp", "sitecustomize_env", "wait_until"]


def sitecustomize_env(directory: Path, source: str, **env: str) -> dict[str, str]:
    """The environment (``env`` added) under which every Python process loads ``source``
    as its ``sitecustomize``, written into ``directory`` (created here)."""
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(source)
    path = os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, **env}


def prompt_turns(messages: list[dict[str, Any]]) -> list[int]:
    """The turn each user prompt of a scripted conversation was (``scripted prompt k``):
    turn numbers read from the prompts themselves, so a lost or repeated turn shows."""
    prompts = [message_text(m) for m in messages if m.get("role") == "user"]
    return [int(p.removeprefix("scripted prompt ")) for p in prompts]
