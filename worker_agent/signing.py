"""Messages from the daemon side prove which task sent them.

Celery messages carry no sender identity, and every daemon pod holds a broker
credential, so anything a pod publishes on the orchestrator's queue could claim to be
any task's. Each task's daemon therefore holds a key of its own (``task_key``: derived
from the orchestrator's message key and the task's namespace, name and uid, so a
restored or re-created task, a new uid, gets a new one) and signs what it sends: its
drain and resume results and its heartbeats carry ``signature``, an HMAC-SHA256 over
the body's canonical JSON. The orchestrator worker derives the key of the task the
ledger says the operation is for (never the one the body claims) and refuses a body
whose signature is missing or wrong before anything touches the ledger.

The operator writes each task's key into a Secret of the task's own (``DRAIN_TASK_KEY``
in its pod); the message key itself never leaves the control plane.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Final

TASK_KEY_ENV: Final = "DRAIN_TASK_KEY"
"""The daemon pod's environment variable holding its task's key (hex)."""
SIGNATURE: Final = "signature"
"""The field of a signed body that carries its signature (hex)."""
KEY_BYTES: Final = 32
"""A message key's least length in bytes (64 hex digits)."""
_DERIVATION: Final = b"caliban-drain task key v1"


class BadKey(ValueError):
    """A key that is not hex, or too short; its text says which, in one line."""


def parse_key(text: str, what: str) -> bytes:
    """``text`` (hex) as a key of at least ``KEY_BYTES`` bytes."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise BadKey(f"{what} is not hexadecimal") from None
    if len(key) < KEY_BYTES:
        raise BadKey(f"{what} has {len(key)} bytes; at least {KEY_BYTES} are needed")
    return key


def task_key(message_key: bytes, namespace: str, name: str, uid: str) -> bytes:
    """The key of task ``namespace/name`` with uid ``uid``: what its daemon signs with."""
    subject = b"\0".join((_DERIVATION, *(part.encode() for part in (namespace, name, uid))))
    return hmac.new(message_key, subject, hashlib.sha256).digest()


def _canonical(body: Mapping[str, object]) -> bytes:
    unsigned = {k: v for k, v in body.items() if k != SIGNATURE}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode()


def sign(key: bytes, body: Mapping[str, object]) -> dict[str, object]:
    """``body`` with its ``signature``."""
    digest = hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()
    return {**body, SIGNATURE: digest}


def signed_by(key: bytes, body: object) -> bool:
    """Whether ``body`` is a JSON object whose ``signature`` is ``key``'s over the rest."""
    if not isinstance(body, Mapping):
        return False
    signature = body.get(SIGNATURE)
    if not isinstance(signature, str):
        return False
    try:
        expected = hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()
    except (TypeError, ValueError):  # not JSON's own types
        return False
    return hmac.compare_digest(signature, expected)
