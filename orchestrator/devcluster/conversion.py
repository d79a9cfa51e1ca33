"""Conversion between the versions of a CRD whose conversion is a webhook the embedded API
cannot call: built-in converters standing in for those webhooks.

A CRD with ``spec.conversion.strategy: Webhook`` names a service in the cluster that
translates objects between its versions; the embedded API calls no webhooks, so it serves
such a CRD only where this module has a converter for it (:func:`converter_for`), and
``resources`` runs that converter on every write into the storage version and every read
through another version, as the API server runs the webhook.

One today: agent-sandbox's Sandbox (``sandboxes.agents.x-k8s.io``), whose webhook
(``agent-sandbox-webhook-service``) converts between ``v1alpha1`` and the storage version
``v1beta1``. What differs between the two schemas, and how it is carried over:

- ``spec.replicas`` (v1alpha1: 0 or 1) is ``spec.operatingMode`` (v1beta1): 0 is
  ``Suspended``; 1 or unset is ``Running``; back, ``Suspended`` is 0 and anything else 1;
- ``status.replicas`` (v1alpha1 only, the pods running) is not kept in v1beta1; read
  through v1alpha1 it follows ``operatingMode`` (0 suspended, else 1), as agent-sandbox's
  webhook answers for an object stored without its v1alpha1 state;
- ``status.nodeName`` (v1beta1 only) is not shown through v1alpha1;
- everything else (pod template, volume claim templates, shutdown time and policy,
  service, the rest of the status) is the same in both.

Pure functions of the object; they never fail on what the schema admits (the store
validates an object against its version's schema before converting it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any, Final

from orchestrator.operator.crd import SANDBOX_CRD, SANDBOX_GROUP, sandbox_suspended

Obj = dict[str, Any]
Converter = Callable[[Mapping[str, Any], str], Obj]
"""``(object at any served version, version name to convert to) → the object there``."""

SUSPENDED: Final = "Suspended"
RUNNING: Final = "Running"


def sandbox_converted(obj: Mapping[str, Any], version: str) -> Obj:
    """A Sandbox (its ``apiVersion`` says at which version) at ``version`` (``v1alpha1``
    or ``v1beta1``), converted as agent-sandbox's webhook converts it."""
    out = copy.deepcopy(dict(obj))
    source = str(out.get("apiVersion", "")).partition("/")[2]
    out["apiVersion"] = f"{SANDBOX_GROUP}/{version}"
    if source == version:
        return out
    suspended = sandbox_suspended(f"{SANDBOX_GROUP}/{source}", out)
    spec, status = out.get("spec"), out.get("status")
    if version == "v1beta1":
        if isinstance(spec, dict):
            spec.pop("replicas", None)
            spec["operatingMode"] = SUSPENDED if suspended else RUNNING
        if isinstance(status, dict):
            status.pop("replicas", None)
    elif version == "v1alpha1":
        if isinstance(spec, dict):
            spec.pop("operatingMode", None)
            spec["replicas"] = 0 if suspended else 1
        if isinstance(status, dict):
            status.pop("nodeName", None)
            status["replicas"] = 0 if suspended else 1
    return out


BUILT_IN: Final[Mapping[str, Converter]] = {SANDBOX_CRD: sandbox_converted}
"""CRD name → the converter standing in for its conversion webhook."""


def converter_for(crd_name: str) -> Converter | None:
    """The built-in converter for the CRD named ``crd_name``, or None (none known)."""
    return BUILT_IN.get(crd_name)
