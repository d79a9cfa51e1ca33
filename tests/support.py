"""Test helpers: the daemon half of the testing kit (``worker_agent.testing``) under the
names the tests import."""

from __future__ import annotations

from worker_agent.testing import DaemonProcess, short_tmp, wait_until

__all__ = ["DaemonProcess", "short_tmp", "wait_until"]
