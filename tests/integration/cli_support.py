"""``drainctl`` as the CLI tests run it: a subprocess with a clean environment (no
``DRAIN_*`` or ``KUBE*`` variables leak in from the caller) plus what the test adds."""

from __future__ import annotations

import os
import subprocess
import sys


def drainctl(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DRAIN_", "KUBE"))}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True, text=True, timeout=timeout, env={**base, **(env or {})},
        check=False,
    )  # fmt: skip
