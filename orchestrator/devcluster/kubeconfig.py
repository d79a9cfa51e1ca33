"""A kubeconfig for the embedded Kubernetes API, accepted by kubectl, kopf and the
official client: one cluster at ``http://127.0.0.1:<port>``, one context, one user with a
placeholder bearer token (by default the embedded API checks no credentials; clients
want one). Given ``token``, the user is that token's instead: a server started with
tokens (``authz``) tells the users apart by it.

Written atomically (a temp file renamed into place), after the server listens, so a
process that waits for the file to appear can use it at once.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import yaml

CONTEXT = "caliban-drain-dev"
DEV_TOKEN = "caliban-drain-dev"  # noqa: S105  # a placeholder: the embedded API checks none


def kubeconfig_document(
    url: str, namespace: str = "default", *, token: str = DEV_TOKEN
) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "preferences": {},
        "clusters": [{"name": CONTEXT, "cluster": {"server": url}}],
        "users": [{"name": CONTEXT, "user": {"token": token}}],
        "contexts": [
            {
                "name": CONTEXT,
                "context": {"cluster": CONTEXT, "user": CONTEXT, "namespace": namespace},
            }
        ],
        "current-context": CONTEXT,
    }


def write_kubeconfig(
    path: Path | str, url: str, namespace: str = "default", *, token: str = DEV_TOKEN
) -> Path:
    """Write (or replace) the kubeconfig at ``path`` (its user's bearer token ``token``);
    returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(kubeconfig_document(url, namespace, token=token), sort_keys=False)
    fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(temp, 0o600)  # kubectl warns about group/world-readable kubeconfigs
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return target
