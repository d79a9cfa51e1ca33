"""The failures of the embedded Kubernetes API, as the ``Status`` bodies clients expect.

kubectl and kopf read ``code``, ``reason`` and ``details`` of a failed request: kubectl
prints ``Error from server (NotFound): calibantasks.caliban.caliban-ai.dev "x" not
found`` and builds ``The CalibanTask "x" is invalid: ...`` from ``details.causes``; kopf
tells a 404 from a 409 by ``code``. Each helper returns kmock's own
:class:`kmock.KubernetesError` (raise it), and :func:`status_body` renders one, so both
the store and the HTTP layer speak the same shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import kmock

from orchestrator.devcluster.resources import ServedResource
from orchestrator.devcluster.schema import FieldError


def status_body(code: int, reason: str, message: str, details: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return body


def api_error(code: int, reason: str, message: str, details: Any = None) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=code, reason=reason, message=message, details=details)


def _object_error(
    code: int, reason: str, resource: ServedResource, name: str, message: str
) -> kmock.KubernetesError:
    details = {"name": name, "group": resource.group, "kind": resource.plural}
    return api_error(code, reason, message, details)


def not_found(resource: ServedResource, name: str) -> kmock.KubernetesError:
    return _object_error(
        404, "NotFound", resource, name, f'{resource.group_resource} "{name}" not found'
    )


def unknown_resource() -> kmock.KubernetesError:
    return api_error(404, "NotFound", "the server could not find the requested resource")


def already_exists(resource: ServedResource, name: str) -> kmock.KubernetesError:
    message = f'{resource.group_resource} "{name}" already exists'
    return _object_error(409, "AlreadyExists", resource, name, message)


def conflict(resource: ServedResource, name: str, why: str) -> kmock.KubernetesError:
    message = f'Operation cannot be fulfilled on {resource.group_resource} "{name}": {why}'
    return _object_error(409, "Conflict", resource, name, message)


def invalid(
    kind: str, group: str, name: str, causes: Sequence[FieldError]
) -> kmock.KubernetesError:
    qualified = f"{kind}.{group}" if group else kind
    texts = [cause.message for cause in causes]
    joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    return api_error(
        422,
        "Invalid",
        f'{qualified} "{name}" is invalid: {joined}',
        {"name": name, "group": group, "kind": kind, "causes": [c.cause() for c in causes]},
    )


def bad_request(message: str) -> kmock.KubernetesError:
    return api_error(400, "BadRequest", message)


def forbidden(message: str) -> kmock.KubernetesError:
    return api_error(403, "Forbidden", message)


NAMESPACE_TERMINATING_CAUSE = "NamespaceTerminating"
"""The cause type a real API server's NamespaceLifecycle admission gives a create refused
in a namespace being deleted (``v1.NamespaceTerminatingCause``)."""


def namespace_terminating(
    resource: ServedResource, name: str, namespace: str
) -> kmock.KubernetesError:
    """A create in ``namespace``, which is being deleted, refused as the NamespaceLifecycle
    admission refuses it: 403, the object named, and cause ``NamespaceTerminating``."""
    return api_error(
        403,
        "Forbidden",
        f'{resource.group_resource} "{name}" is forbidden: unable to create new content in '
        f"namespace {namespace} because it is being terminated",
        {
            "name": name,
            "group": resource.group,
            "kind": resource.plural,
            "causes": [
                {
                    "reason": NAMESPACE_TERMINATING_CAUSE,
                    "message": f"namespace {namespace} is being terminated",
                    "field": "metadata.namespace",
                }
            ],
        },
    )


def method_not_allowed(
    message: str = "the server does not allow this method on the requested resource",
) -> kmock.KubernetesError:
    return api_error(405, "MethodNotAllowed", message)


def unsupported_media_type(content_type: str) -> kmock.KubernetesError:
    return api_error(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - "
        f"accepted media types include: application/json-patch+json, "
        f"application/merge-patch+json, application/apply-patch+yaml, "
        f"application/strategic-merge-patch+json (got {content_type!r})",
    )


def expired(message: str) -> kmock.KubernetesError:
    return api_error(410, "Expired", message)
