from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import DaemonProcess, short_tmp


@pytest.fixture
def tmp_short() -> Iterator[Path]:
    with short_tmp() as path:
        yield path


@pytest.fixture
def daemon(tmp_short: Path) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_short).start()
    try:
        yield proc
    finally:
        proc.stop()
