"""Upstream's files as test data (``tests/fixtures/upstream``): caliban-operator's
CalibanTask and Workspace CRDs and samples, and agent-sandbox's Sandbox CRD.

The files are verbatim copies (their README names source, tag, commit and licence). Their
samples name hosts that are not on this machine (a git remote, an ollama in a private
address range), so tests take the samples through ``local_samples``, which rewrites every
host in them to 127.0.0.1: no test ever contacts an address outside this machine.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

UPSTREAM = Path(__file__).resolve().parent / "fixtures" / "upstream"
CALIBAN_OPERATOR = UPSTREAM / "caliban-operator"
AGENT_SANDBOX = UPSTREAM / "agent-sandbox"
CALIBANTASK_CRD = CALIBAN_OPERATOR / "deploy" / "crd" / "calibantask.yaml"
WORKSPACE_CRD = CALIBAN_OPERATOR / "deploy" / "crd" / "workspace.yaml"
SAMPLES = CALIBAN_OPERATOR / "deploy" / "samples"
NAMES_SOURCE = CALIBAN_OPERATOR / "src" / "config.rs"
"""caliban-operator's source of its children's names (``sandbox_name``), as text."""
SANDBOX_CRD = AGENT_SANDBOX / "k8s" / "crds" / "agents.x-k8s.io_sandboxes.yaml"

LOCAL_HOST = "127.0.0.1"

# ``scheme://[user@]host[:port]/…`` and git's scp-like ``user@host:path``.
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_SCP_LIKE = re.compile(r"^(?P<user>[^@/:\s]+)@(?P<host>[^:/\s]+):(?P<path>(?!//).*)$")


def load(path: Path) -> dict[str, Any]:
    loaded = yaml.safe_load(path.read_text())
    assert isinstance(loaded, dict), f"{path} is not one YAML mapping"
    return loaded


def localize(text: str, host: str = LOCAL_HOST) -> str:
    """``text`` with the host of a URL or scp-like git remote replaced by ``host``; any
    other string unchanged."""
    if _URL.match(text):
        parts = urlsplit(text)
        if parts.hostname is None:
            return text
        user = f"{parts.username}@" if parts.username else ""
        port = f":{parts.port}" if parts.port else ""
        return urlunsplit(parts._replace(netloc=f"{user}{host}{port}"))
    scp = _SCP_LIKE.match(text)
    if scp:
        return f"{scp['user']}@{host}:{scp['path']}"
    return text


def localized(value: Any, host: str = LOCAL_HOST) -> Any:
    """A copy of a loaded manifest with every string taken through ``localize``."""
    if isinstance(value, dict):
        return {key: localized(item, host) for key, item in value.items()}
    if isinstance(value, list):
        return [localized(item, host) for item in value]
    if isinstance(value, str):
        return localize(value, host)
    return value


def local_samples() -> dict[str, dict[str, Any]]:
    """Upstream's samples by file name, each rewritten to name only 127.0.0.1."""
    return {path.name: localized(load(path)) for path in sorted(SAMPLES.glob("*.yaml"))}


def strings(value: Any) -> Iterator[str]:
    """Every string in a loaded manifest, keys included."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)
    elif isinstance(value, str):
        yield value
