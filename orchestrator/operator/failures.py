"""A failure as one log line: what the operator's loops say when a pass, a deletion,
the ledger feed or the snapshot follower fails (the traceback goes to debug)."""

from __future__ import annotations

import json

from kubernetes.client.exceptions import ApiException
from kubernetes_asyncio.client.exceptions import ApiException as AsyncApiException


def one_line(exc: BaseException) -> str:
    """What failed, on one line: the exception's type and the first line of its text; for
    a refusal of the API, its status and the message of its Status body."""
    if isinstance(exc, ApiException | AsyncApiException):
        try:
            said = json.loads(exc.body or "{}").get("message")
        except (ValueError, AttributeError):
            said = None
        return f"ApiException: ({exc.status}) {exc.reason}: {str(said or '')[:300]}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__
