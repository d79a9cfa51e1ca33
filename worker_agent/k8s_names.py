"""Kubernetes names, validated as the API server validates them (``k8s.io/apimachinery``
``IsDNS1123Label``, ``IsDNS1123Subdomain``, ``IsDNS1035Label``), in one place for both
halves: the daemon side checks the task names its queue carries (``contract``), the
operator the names a spec gives (``orchestrator.operator``), the embedded API the names
of what it stores.

A label is 1-63 lowercase alphanumerics and ``-``, starting and ending alphanumeric (a
DNS-1035 label, what a Service is named, also starts with a letter); a subdomain is
labels joined by ``.``, 253 characters in all (``a..b`` is none: an empty label).
"""

from __future__ import annotations

import re
from typing import Final

DNS_LABEL_MAX: Final = 63
DNS_SUBDOMAIN_MAX: Final = 253
_LABEL: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def is_dns_label(name: object) -> bool:
    """Whether ``name`` is a DNS-1123 label: a namespace, a Service, a Sandbox."""
    return isinstance(name, str) and len(name) <= DNS_LABEL_MAX and bool(_LABEL.fullmatch(name))


def is_dns_subdomain(name: object) -> bool:
    """Whether ``name`` is a DNS-1123 subdomain: most objects' names."""
    return (
        isinstance(name, str)
        and len(name) <= DNS_SUBDOMAIN_MAX
        and all(_LABEL.fullmatch(part) for part in name.split("."))
    )


def is_dns1035_label(name: object) -> bool:
    """Whether ``name`` is a DNS-1035 label, a DNS-1123 label that starts with a letter:
    what a Service may be named (agent-sandbox names a Sandbox's Service after it)."""
    return is_dns_label(name) and str(name)[:1].isalpha()
