"""``drainctl operator``'s process: kopf in the foreground running the registrations of
``operator.handlers`` with the settings the command line gave."""

from __future__ import annotations

import logging

import kopf

from orchestrator.operator.crd import Manifest
from orchestrator.operator.handlers import watch_children
from orchestrator.settings import Settings

log = logging.getLogger(__name__)


def run_operator(
    *,
    namespaces: list[str] | None,
    manage_sandbox: bool,
    peering: str | None = None,
    liveness: str | None = None,
    existing_sandboxes: bool = False,
) -> None:
    """``drainctl operator``: kopf in the foreground; standalone (one replica) unless
    ``peering`` (or ``DRAIN_PEERING``) names the peering object its replicas share
    (``operator.peering``). ``liveness``: the URL kopf serves its health probe on. The
    flags override the ``DRAIN_*`` settings they name."""
    from orchestrator.operator.peering import own_priority

    flags: Manifest = {}
    if manage_sandbox:
        flags["manage_sandbox"] = True
    if existing_sandboxes:
        flags["existing_sandboxes"] = True
    if peering is not None:
        flags["peering"] = peering
    settings = Settings(**flags)
    if settings.manage_sandbox:
        watch_children()
    priority = None if settings.peering is None else own_priority(settings.peering_priority)
    if priority is not None:
        log.info(
            "operator_peering name=%s priority=%d lifetime_secs=%d",
            settings.peering,
            priority,
            settings.peering_lifetime_secs,
        )
    kopf.run(
        standalone=settings.peering is None,
        peering_name=settings.peering,
        priority=priority,
        clusterwide=not namespaces,
        namespaces=namespaces or [],
        liveness_endpoint=liveness,
        memo=kopf.Memo(drain_settings=settings),
    )
