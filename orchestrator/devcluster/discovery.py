"""Discovery documents of the embedded Kubernetes API, built from the resource registry.

Clients learn what a server serves before they touch an object: kubectl asks for the
aggregated form (``apidiscovery.k8s.io`` ``APIGroupDiscoveryList``) of ``/api`` and
``/apis`` and falls back to the legacy ``APIVersions``/``APIGroupList``/``APIGroup``/
``APIResourceList`` documents, which kopf reads. Both list kind, plural, singular,
shortNames, categories, verbs, scope and the ``status`` subresource: kubectl resolves
``ctask`` through them, and kopf patches ``.status`` through the subresource only when
discovery lists it.

kubectl also reads ``/openapi/v3`` before a write to decide who validates fields; a
minimal document per group-version, whose PATCH operations take ``fieldValidation``,
tells it this server does (``store`` applies CRD schemas), so it needs no full schema.
Pure functions of the registry; ``emulator`` serves them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from orchestrator.devcluster.resources import STATUS_VERBS, ResourceRegistry, ServedResource

SERVER_VERSION = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0+caliban-drain.devcluster",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.23",
    "compiler": "gc",
    "platform": "linux/amd64",
}
AGGREGATED_CONTENT_TYPE = (
    "application/json;g=apidiscovery.k8s.io;v={version};as=APIGroupDiscoveryList"
)
HEALTH_PATHS = ("/healthz", "/readyz", "/livez")


def root_paths(registry: ResourceRegistry) -> dict[str, Any]:
    paths = {"/api", "/api/v1", "/apis", "/version", "/openapi/v3", *HEALTH_PATHS}
    for group, versions in registry.groups().items():
        if group:
            paths.add(f"/apis/{group}")
            paths.update(f"/apis/{group}/{version}" for version in versions)
    return {"paths": sorted(paths)}


def api_versions(server_address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}
        ],
    }


def api_group_list(registry: ResourceRegistry) -> dict[str, Any]:
    groups = [api_group(g, versions) for g, versions in registry.groups().items() if g]
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def api_group(group: str, versions: list[str]) -> dict[str, Any]:
    listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": group,
        "versions": listed,
        "preferredVersion": listed[0],
    }


def api_resource_list(registry: ResourceRegistry, group: str, version: str) -> dict[str, Any]:
    entries: list[dict[str, Any]] = []
    for served in registry.in_group_version(group, version):
        entry = {
            "name": served.plural,
            "singularName": served.singular,
            "namespaced": served.namespaced,
            "kind": served.kind,
            "verbs": list(served.verbs),
        }
        if served.short_names:
            entry["shortNames"] = list(served.short_names)
        if served.categories:
            entry["categories"] = list(served.categories)
        entries.append(entry)
        if served.status_subresource:
            entries.append(
                {
                    "name": f"{served.plural}/status",
                    "singularName": "",
                    "namespaced": served.namespaced,
                    "kind": served.kind,
                    "verbs": list(STATUS_VERBS),
                }
            )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": entries,
    }


def aggregated_version(accept: str) -> str | None:
    """Which ``apidiscovery.k8s.io`` version the client accepts, if any (v2 preferred)."""
    offers = [part.replace(" ", "") for part in accept.split(",")]
    wanted = [o for o in offers if "as=APIGroupDiscoveryList" in o]
    if any("v=v2;" in o + ";" and "v=v2beta1" not in o for o in wanted):
        return "v2"
    return "v2beta1" if wanted else None


def aggregated_discovery(registry: ResourceRegistry, *, core: bool, version: str) -> dict[str, Any]:
    """Every group (the core one for ``/api``, the others for ``/apis``) in one document."""
    items = []
    for group, versions in registry.groups().items():
        if (group == "") != core:
            continue
        metadata: dict[str, Any] = {"creationTimestamp": None}
        if group:
            metadata["name"] = group
        items.append(
            {
                "metadata": metadata,
                "versions": [
                    {
                        "version": v,
                        "resources": [
                            _aggregated_resource(r) for r in registry.in_group_version(group, v)
                        ],
                        "freshness": "Current",
                    }
                    for v in versions
                ],
            }
        )
    return {
        "kind": "APIGroupDiscoveryList",
        "apiVersion": f"apidiscovery.k8s.io/{version}",
        "metadata": {},
        "items": items,
    }


def _aggregated_resource(served: ServedResource) -> dict[str, Any]:
    kind = {"group": served.group, "version": served.version, "kind": served.kind}
    entry: dict[str, Any] = {
        "resource": served.plural,
        "responseKind": kind,
        "scope": "Namespaced" if served.namespaced else "Cluster",
        "singularResource": served.singular,
        "verbs": list(served.verbs),
    }
    if served.short_names:
        entry["shortNames"] = list(served.short_names)
    if served.categories:
        entry["categories"] = list(served.categories)
    if served.status_subresource:
        entry["subresources"] = [
            {"subresource": "status", "responseKind": kind, "verbs": list(STATUS_VERBS)}
        ]
    return entry


# ------------------------------------------------------------------ OpenAPI v3 (minimal)


def _gv_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def openapi_v3_index(registry: ResourceRegistry) -> dict[str, Any]:
    """``/openapi/v3``: each group-version's document, addressed with a hash of its
    content (clients cache documents by it)."""
    paths = {}
    for group, versions in registry.groups().items():
        for version in versions:
            gv = _gv_path(group, version)
            document = openapi_v3_document(registry, group, version)
            digest = hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()
            paths[gv] = {"serverRelativeURL": f"/openapi/v3/{gv}?hash={digest[:32].upper()}"}
    return {"paths": paths}


def parse_openapi_v3_path(rest: str) -> tuple[str, str] | None:
    """``api/v1`` → ``("", "v1")``; ``apis/g/v`` → ``("g", "v")``."""
    parts = rest.strip("/").split("/")
    if len(parts) == 2 and parts[0] == "api":
        return "", parts[1]
    if len(parts) == 3 and parts[0] == "apis":
        return parts[1], parts[2]
    return None


def openapi_v3_document(registry: ResourceRegistry, group: str, version: str) -> dict[str, Any]:
    """The object paths of one group-version with the group-version-kind and parameters
    of each operation; no schemas (``kubectl explain`` has nothing to show)."""
    writes = [
        {"name": name, "in": "query", "schema": {"type": "string", "uniqueItems": True}}
        for name in ("dryRun", "fieldManager", "fieldValidation")
    ]
    gv = _gv_path(group, version)
    paths: dict[str, Any] = {}
    for served in registry.in_group_version(group, version):
        gvk = {"group": group, "version": version, "kind": served.kind}
        base = (
            f"/{gv}/namespaces/{{namespace}}/{served.plural}"
            if served.namespaced
            else f"/{gv}/{served.plural}"
        )
        paths[base] = {"get": _operation("list", gvk, []), "post": _operation("post", gvk, writes)}
        paths[f"{base}/{{name}}"] = {
            "get": _operation("get", gvk, []),
            "put": _operation("put", gvk, writes),
            "patch": _operation("patch", gvk, writes),
            "delete": _operation("delete", gvk, []),
        }
        if served.status_subresource:
            paths[f"{base}/{{name}}/status"] = {
                "get": _operation("get", gvk, []),
                "put": _operation("put", gvk, writes),
                "patch": _operation("patch", gvk, writes),
            }
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": SERVER_VERSION["gitVersion"]},
        "paths": paths,
    }


def _operation(
    action: str, gvk: dict[str, str], parameters: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": gvk,
        "parameters": parameters,
        "responses": {"200": {"description": "OK"}},
    }
