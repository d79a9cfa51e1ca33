"""The HTTP face of the embedded Kubernetes API: kmock's emulator, extended.

:class:`DevClusterEmulator` is a :class:`kmock.KubernetesEmulator`, so it keeps kmock's
request model, its reaction DSL and its object store: a test can inject a fault with
``emulator["patch calibantasks"] << 500`` (reactions a test adds rank above everything
here, and are recorded as kmock records them), and ``emulator.objects`` holds every
object. What it changes, and why kmock alone is not enough for kubectl and kopf:

- **Request parsing** (``__call__``): kmock's path parser fails on ``/api/v1/namespaces``
  (it takes ``namespaces`` for the namespace marker), so namespaces could not be listed
  or created. Requests are parsed here into the same :class:`kmock.Request`, with
  namespaces, the ``status``/``finalize`` subresources, ``PUT`` and the protobuf bodies of
  ``kubectl create namespace|configmap|secret`` (``protobuf``) understood.
- **Writes**: kmock's emulator deep-merges every PATCH as a dict, keeps no
  resourceVersion, generation, status-subresource or garbage-collection rules, and
  applies writes before the reactions run. Here nothing is written outside
  :class:`~orchestrator.devcluster.store.ClusterState`.
- **Answers**: a reaction just above kmock's own fallbacks claims every request no test
  reaction took, and this class answers it itself. kmock's rendering is not used for
  these answers because a status or header a callback returns is stored on the shared
  reaction (a 201 of one create would stay on every later answer); kmock renders only
  the reactions a test adds.
- **Discovery** (``discovery``), **Tables** for ``kubectl get``, watches that resume from a
  resourceVersion and end at ``timeoutSeconds``, list kinds, selectors, and ``Status``
  errors without kmock's tracebacks.

kmock keeps every request for assertions; a long-running dev server keeps only the last
``request_retention``. ``apiserver`` puts this handler on a socket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import kmock

# Not re-exported at kmock's top level, but part of the handler protocol it documents.
from kmock._internal.rendering import StreamingError
from typing_extensions import override

from orchestrator.devcluster import (
    authz,
    discovery,
    errors,
    patching,
    protobuf,
    resources,
    selectors,
    tables,
)
from orchestrator.devcluster.resources import ResourceRegistry, ServedResource
from orchestrator.devcluster.selectors import is_watch
from orchestrator.devcluster.store import ClusterState, WatchQuery, Writer

log = logging.getLogger(__name__)


class _Claimed(Exception):
    """Raised by the fallback reaction: no test reaction took the request, so the
    emulator answers it itself (see the module docstring)."""


@dataclass(frozen=True)
class Address:
    """Where a resource request points:
    ``/api[s]/<gv>/[namespaces/<ns>/]<plural>[/<name>[/<sub>]]``."""

    group: str
    version: str
    plural: str
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None


def parse_address(path: str) -> Address | None:
    parts = [part for part in path.split("/") if part]
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    # /namespaces/<ns>/<plural>/... addresses namespaced objects, but /namespaces/<ns>/status
    # and /namespaces/<ns>/finalize are subresources of the namespace itself.
    namespace_subresource = len(rest) == 3 and rest[2] in ("status", "finalize")
    if rest[0] == "namespaces" and len(rest) >= 3 and not namespace_subresource:
        namespace, rest = rest[1], rest[2:]
    name = rest[1] if len(rest) > 1 else None
    subresource = "/".join(rest[2:]) or None
    return Address(group, version, rest[0], namespace, name, subresource)


def _action(address: Address | None, method: str, query: Mapping[str, str]) -> kmock.action | None:
    if address is None:
        return None
    if method == "GET":
        if is_watch(query):
            return kmock.action.WATCH
        return kmock.action.FETCH if address.name else kmock.action.LIST
    actions = {
        "POST": kmock.action.CREATE,
        "PATCH": kmock.action.UPDATE,
        "DELETE": kmock.action.DELETE,
    }
    return actions.get(method)


def _writer(request: kmock.Request, *, apply: bool = False) -> Writer:
    """The field manager of a write: the ``fieldManager`` parameter, else (except for an
    apply, which must name one) the User-Agent's product, as a real server derives it:
    ``kubectl`` from ``kubectl/v1.32.4 (linux/amd64) kubernetes/…``."""
    manager = request.params.get("fieldManager", "")
    if not manager and not apply:
        agent = _header(request.headers, "User-Agent").split("/")[0]
        manager = "".join(ch for ch in agent if ch.isprintable())[:128]
    # The server parses booleans as Go's strconv.ParseBool does; the Python client sends "True".
    force = request.params.get("force") in ("1", "t", "T", "TRUE", "true", "True")
    return Writer(manager, force=force)


def _header(headers: Mapping[str, str], name: str) -> str:
    """A header by its case-insensitive name (kmock keeps them in a plain dict)."""
    wanted = name.lower()
    return next((value for key, value in headers.items() if key.lower() == wanted), "")


def _is_protobuf(headers: Mapping[str, str]) -> bool:
    return _header(headers, "Content-Type").startswith(protobuf.CONTENT_TYPE)


def _json(
    body: Any,
    status: int = 200,
    *,
    content_type: str = "application/json",
    warnings: Sequence[str] = (),
) -> aiohttp.web.Response:
    headers = {"Content-Type": content_type}
    if warnings:
        headers["Warning"] = ", ".join(f'299 - "{json.dumps(w)[1:-1]}"' for w in warnings)
    return aiohttp.web.Response(body=json.dumps(body).encode(), status=status, headers=headers)


REQUESTS_PATH = "/debug/requests"
"""``GET``: how many requests the embedded API has answered, by method and ``User-Agent``
(a JSON object, keys ``"<method> <User-Agent>"``; these requests not counted): what a
benchmark reads to count the calls each client made (kopf and the official client say
who they are)."""


@attrs.define(kw_only=True)
class DevClusterEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with the semantics kubectl and kopf rely on."""

    request_retention: int = 2_000
    access: authz.AccessControl | None = None  # None: no authentication, as by default
    registry: ResourceRegistry = attrs.field(factory=ResourceRegistry, init=False)
    state: ClusterState = attrs.field(init=False)
    _seen: int = attrs.field(default=0, init=False)
    requests: Counter[str] = attrs.field(factory=Counter, init=False)
    """Requests answered, by ``"<method> <User-Agent>"`` (``REQUESTS_PATH`` serves them)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for served in authz.served_resources():
            self.registry.serve(served)
        self.state = ClusterState(
            self.objects, self.registry, on_resources_changed=self._mirror_resources
        )
        self._mirror_resources()
        # Just above kmock's own fallbacks and below any reaction a test adds.
        (self.fallback**1) << self._claim

    # ------------------------------------------------------------------ the request cycle

    @override
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        started = time.monotonic()
        if raw_request.path == REQUESTS_PATH and raw_request.method == "GET":
            return _json(dict(self.requests))
        self.requests[f"{raw_request.method} {raw_request.headers.get('User-Agent', '')}"] += 1
        request = await self._parse(raw_request)
        response: aiohttp.web.StreamResponse
        try:
            try:
                if self.access is not None:
                    self._admit(self.access, request)
                response = await self._handle(request)
            except _Claimed:
                response = await self._serve(request, raw_request)
        except StreamingError as exc:  # a test reaction's stream failed after it began
            response = exc.args[0]
            cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
            await self._stream_error(cause, response)
            await response.write_eof()
        except Exception as exc:
            response = await self._render_error(exc)
        log.debug(
            "request method=%s path=%s query=%s status=%s ms=%.1f",
            request.method.value,
            request.url.path,
            request.url.query_string or "-",
            response.status,
            (time.monotonic() - started) * 1000,
        )
        return response

    def _admit(self, access: authz.AccessControl, request: kmock.Request) -> None:
        """Authenticate, record and authorize one request (``authz``); raises the 401 or
        403 it gets. Discovery and health paths are every user's (``system:discovery``)."""
        user = access.authenticate(request.headers)
        attrs = authz.attributes_of(request)
        if attrs is None:
            return
        allowed = access.decide(self._policy(), user, attrs)
        access.record(user, attrs, allowed)
        if not allowed:
            raise authz.forbidden(user, attrs)

    def _policy(self) -> authz.Policy:
        def stored(key: resources.ResourceKey) -> list[dict[str, Any]]:
            served = self.registry.lookup(*key)
            assert served is not None  # served from the start
            return self.state.list_objects(WatchQuery(served, None, None))[0]

        return authz.Policy.of(
            stored(authz.ROLES),
            stored(authz.CLUSTER_ROLES),
            stored(authz.ROLE_BINDINGS),
            stored(authz.CLUSTER_ROLE_BINDINGS),
        )

    def _review(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """A SelfSubjectAccessReview, answered for the requesting user and not stored."""
        if request.method.value != "POST" or request.name is not None:
            raise errors.method_not_allowed()
        asked = authz.review_attributes(request.data)
        if self.access is None or not self.access.authorize:
            return _json(authz.review_answer(request.data, True, "no authorization"), 201)
        user = self.access.authenticate(request.headers)
        ok = authz.allowed(self._policy(), user, asked)
        reason = "RBAC: allowed" if ok else ""
        return _json(authz.review_answer(request.data, ok, reason), 201)

    @override
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # Skip KubernetesEmulator._handle: its dict-merging writes would run before (and in
        # addition to) ours. Straight to kmock's reaction matching.
        return await kmock.RawHandler._handle(self, request)

    @staticmethod
    def _claim() -> None:
        raise _Claimed

    async def _parse(self, raw_request: aiohttp.web.BaseRequest) -> kmock.Request:
        body = await raw_request.read()
        data: Any = None
        if body and _is_protobuf(raw_request.headers):
            with contextlib.suppress(protobuf.ProtobufError):  # _serve says what is wrong
                data = protobuf.decode(body)
        elif body:
            try:
                data = json.loads(body)
            except ValueError:
                data = None  # a YAML apply patch, or garbage: the handler decides
        query = dict(raw_request.query)
        address = parse_address(raw_request.path)
        request = kmock.Request(
            id=self._seen,
            raw_request=raw_request,
            url=raw_request.url,
            method=raw_request.method,
            params=query,
            headers=dict(raw_request.headers),
            cookies=dict(raw_request.cookies),
            body=body,
            text=body.decode("utf-8", errors="replace"),
            data=data,
            action=_action(address, raw_request.method.upper(), query),
            resource=kmock.resource(address.group, address.version, address.plural)
            if address
            else None,
            namespace=address.namespace if address else None,
            name=address.name if address else None,
            subresource=address.subresource if address else None,
        )
        self._remember(request)
        return request

    def _remember(self, request: kmock.Request) -> None:
        """kmock keeps every request (for assertions); keep only the recent ones."""
        self._seen += 1
        self._requests.append(request)
        if len(self._requests) > 2 * self.request_retention:
            del self._requests[: -self.request_retention]
            for reaction in self._payloads:
                del reaction._requests[: -self.request_retention]

    @override
    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, kmock.KubernetesError):
            reason, message = exc.reason or "InternalError", exc.message or repr(exc)
            return _json(errors.status_body(exc.status, reason, message, exc.details), exc.status)
        log.exception("request failed error=%r", exc)
        if self._errors:
            self._errors[-1].append(exc)  # kmock's own record of server-side failures
        return _json(errors.status_body(500, "InternalError", repr(exc)), 500)

    def _mirror_resources(self) -> None:
        """Keep kmock's ``resources`` in step, for anything that asks kmock what is served."""
        self.resources.clear()
        for served in self.registry:
            self.resources[kmock.resource(served.group, served.version, served.plural)] = (
                kmock.ResourceInfo(
                    namespaced=served.namespaced,
                    kind=served.kind,
                    singular=served.singular,
                    verbs=set(served.verbs),
                    shortnames=set(served.short_names),
                    categories=set(served.categories),
                    subresources={"status"} if served.status_subresource else set(),
                )
            )

    async def _serve(
        self, request: kmock.Request, raw: aiohttp.web.BaseRequest
    ) -> aiohttp.web.StreamResponse:
        if request.body and request.data is None and _is_protobuf(request.headers):
            try:
                protobuf.decode(request.body)
            except protobuf.ProtobufError as exc:
                raise errors.api_error(415, "UnsupportedMediaType", str(exc)) from exc
        if request.resource is not None:
            return await self._serve_resource(request, raw)
        if request.method == kmock.method.GET:
            return self._serve_discovery(request)
        raise errors.method_not_allowed()

    # ------------------------------------------------------------------ discovery

    def _serve_discovery(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path.rstrip("/") or "/"
        registry = self.registry
        if path == "/":
            return _json(discovery.root_paths(registry))
        if path == "/version":
            return _json(discovery.SERVER_VERSION)
        if path in discovery.HEALTH_PATHS:
            return aiohttp.web.Response(text="ok")
        if path == "/openapi/v3":
            return _json(discovery.openapi_v3_index(registry))
        if path.startswith("/openapi/v3/"):
            gv = discovery.parse_openapi_v3_path(path.removeprefix("/openapi/v3/"))
            if gv is None or gv[1] not in registry.groups().get(gv[0], []):
                raise errors.unknown_resource()
            return _json(discovery.openapi_v3_document(registry, *gv))
        aggregated = discovery.aggregated_version(_header(request.headers, "Accept"))
        if path in ("/api", "/apis") and aggregated is not None:
            body = discovery.aggregated_discovery(registry, core=path == "/api", version=aggregated)
            return _json(
                body, content_type=discovery.AGGREGATED_CONTENT_TYPE.format(version=aggregated)
            )
        if path == "/api":
            return _json(discovery.api_versions(request.url.raw_authority or "127.0.0.1"))
        if path == "/apis":
            return _json(discovery.api_group_list(registry))
        parts = path.strip("/").split("/")
        if parts == ["api", "v1"]:
            return _json(discovery.api_resource_list(registry, "", "v1"))
        if parts[0] == "apis" and len(parts) in (2, 3):
            versions = registry.groups().get(parts[1]) if parts[1] else None
            if versions and len(parts) == 2:
                return _json(discovery.api_group(parts[1], versions))
            if versions and parts[2] in versions:
                return _json(discovery.api_resource_list(registry, parts[1], parts[2]))
        raise errors.unknown_resource()

    # ------------------------------------------------------------------ resources

    async def _serve_resource(
        self, request: kmock.Request, raw: aiohttp.web.BaseRequest
    ) -> aiohttp.web.StreamResponse:
        assert request.resource is not None  # the caller checked
        served = self.registry.lookup(
            request.resource.group or "",
            request.resource.version or "",
            request.resource.plural or "",
        )
        if served is None or (request.namespace is not None and not served.namespaced):
            raise errors.unknown_resource()
        if served.key == authz.SELF_SUBJECT_ACCESS_REVIEWS:
            return self._review(request)
        response = await self._serve_served(request, raw, served)
        if served.deprecation_warning and not response.prepared:  # a watch streams at once
            # A deprecated CRD version warns on every request, as the API server does
            # (kubectl prints "Warning: …").
            said = response.headers.get("Warning")
            warning = f'299 - "{json.dumps(served.deprecation_warning)[1:-1]}"'
            response.headers["Warning"] = f"{said}, {warning}" if said else warning
        return response

    async def _serve_served(
        self, request: kmock.Request, raw: aiohttp.web.BaseRequest, served: ServedResource
    ) -> aiohttp.web.StreamResponse:
        if request.params.get("dryRun"):
            raise errors.bad_request("dry-run is not supported by the embedded API server")
        subresource = request.subresource
        allowed = {None, "status"} | ({"finalize"} if served.key == resources.NAMESPACES else set())
        if subresource not in allowed or (
            subresource == "status" and not served.status_subresource
        ):
            raise errors.unknown_resource()
        method = request.method.value
        if method == "GET":
            if is_watch(request.params):
                return await self._watch(request, raw, served)
            if request.name is not None:
                obj = self.state.get(served, request.namespace, request.name)
                return self._objects_response(request, served, [obj], single=True)
            items, _ = self.state.list_objects(self._query(request, served))
            return self._objects_response(request, served, items, single=False)
        if method == "POST" and request.name is None:
            created, warnings = self.state.create(
                served,
                request.namespace,
                request.data,
                field_validation=self._field_validation(request),
                writer=_writer(request),
            )
            return _json(created, 201, warnings=warnings)
        if method == "PUT" and request.name is not None:
            replaced, warnings = self.state.replace(
                served,
                request.namespace,
                request.name,
                request.data,
                subresource=subresource,
                field_validation=self._field_validation(request),
                writer=_writer(request),
            )
            return _json(replaced, 200, warnings=warnings)
        if method == "PATCH" and request.name is not None:
            return self._patch(request, served)
        if method == "DELETE":
            return self._delete(request, served)
        raise errors.method_not_allowed()

    def _patch(self, request: kmock.Request, served: ServedResource) -> aiohttp.web.StreamResponse:
        assert request.name is not None  # the caller checked
        content_type = _header(request.headers, "Content-Type").split(";")[0].strip().lower()
        if content_type not in patching.PATCH_TYPES:
            raise errors.unsupported_media_type(content_type)
        try:
            patch = patching.decode_patch(content_type, request.text, request.data)
        except patching.PatchError as exc:
            raise errors.bad_request(str(exc)) from exc
        if content_type == patching.APPLY_PATCH and not request.subresource:
            self._admit_apply_create(request, served)
        obj, warnings, created = self.state.patch(
            served,
            request.namespace,
            request.name,
            content_type,
            patch,
            subresource=request.subresource,
            field_validation=self._field_validation(request),
            writer=_writer(request, apply=content_type == patching.APPLY_PATCH),
        )
        return _json(obj, 201 if created else 200, warnings=warnings)

    def _admit_apply_create(self, request: kmock.Request, served: ServedResource) -> None:
        """A server-side apply of an object that is not there creates it, so it needs the
        ``create`` verb besides ``patch``, as the API server authorizes it."""
        if self.access is None or not self.access.authorize:
            return
        assert request.name is not None  # a patch names its object
        try:
            self.state.get(served, request.namespace, request.name)
        except kmock.KubernetesError:
            pass  # not there: the apply creates it
        else:
            return
        user = self.access.authenticate(request.headers)
        attrs = authz.attributes_of(request)
        assert attrs is not None  # a resource request
        creating = dataclasses.replace(attrs, verb="create")
        allowed = self.access.decide(self._policy(), user, creating)
        self.access.record(user, creating, allowed)
        if not allowed:
            raise authz.forbidden(user, creating)

    def _delete(self, request: kmock.Request, served: ServedResource) -> aiohttp.web.StreamResponse:
        options = dict(request.data) if isinstance(request.data, Mapping) else {}
        for key in ("propagationPolicy", "orphanDependents"):
            if key in request.params:
                options[key] = (
                    request.params[key]
                    if key != "orphanDependents"
                    else request.params[key] == "true"
                )
        if request.name is None:
            deleted = self.state.delete_collection(self._query(request, served), options)
            return _json(self._list_body(served, deleted, self.state.resource_version))
        obj, gone = self.state.delete(served, request.namespace, request.name, options)
        return _json(obj, 200 if gone else 202)

    @staticmethod
    def _field_validation(request: kmock.Request) -> str:
        wanted = request.params.get("fieldValidation", "Warn")
        return wanted if wanted in ("Strict", "Warn", "Ignore") else "Warn"

    @staticmethod
    def _query(request: kmock.Request, served: ServedResource) -> WatchQuery:
        try:
            labels = selectors.parse_label_selector(request.params.get("labelSelector"))
            fields = selectors.parse_field_selector(request.params.get("fieldSelector"))
        except selectors.SelectorError as exc:
            raise errors.bad_request(str(exc)) from exc
        return WatchQuery(served, request.namespace, request.name, labels, fields)

    def _objects_response(
        self,
        request: kmock.Request,
        served: ServedResource,
        items: list[dict[str, Any]],
        *,
        single: bool,
    ) -> aiohttp.web.StreamResponse:
        rv = self.state.resource_version
        if "as=Table" in _header(request.headers, "Accept"):
            include_object = request.params.get("includeObject", "Metadata")
            return _json(
                tables.build_table(
                    served.columns, items, resource_version=rv, include_object=include_object
                )
            )
        return _json(items[0] if single else self._list_body(served, items, rv))

    @staticmethod
    def _list_body(served: ServedResource, items: list[dict[str, Any]], rv: str) -> dict[str, Any]:
        return {
            "apiVersion": served.api_version,
            "kind": f"{served.kind}List",
            "metadata": {"resourceVersion": rv},
            "items": items,
        }

    # ------------------------------------------------------------------ watches

    async def _watch(
        self, request: kmock.Request, raw: aiohttp.web.BaseRequest, served: ServedResource
    ) -> aiohttp.web.StreamResponse:
        timeout_text = request.params.get("timeoutSeconds")
        try:
            timeout = float(timeout_text) if timeout_text else None
        except ValueError:
            raise errors.bad_request(f"invalid timeoutSeconds: {timeout_text!r}") from None
        stream = self.state.open_watch(  # errors here are still plain HTTP errors
            self._query(request, served),
            since=request.params.get("resourceVersion"),
            send_initial=request.params.get("sendInitialEvents") == "true",
            timeout=timeout,
        )
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)  # the headers go now: clients wait for them
        log.debug("watch started path=%s query=%s", request.url.path, request.url.query_string)
        try:
            async for event in self._watch_events(request, served, stream):
                await response.write(json.dumps(event).encode() + b"\n")
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away; nothing to finish
        finally:  # also when the client's disconnect cancels this handler
            log.debug("watch ended path=%s", request.url.path)
        return response

    @staticmethod
    async def _watch_events(
        request: kmock.Request, served: ServedResource, stream: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[dict[str, Any]]:
        """The events, as Tables when ``kubectl get -w`` asks for them (the column
        definitions only in the first, as a real server sends them)."""
        as_table = "as=Table" in _header(request.headers, "Accept")
        include_object = request.params.get("includeObject", "Metadata")
        first = True
        async for event in stream:
            if as_table and event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                obj = event["object"]
                table = tables.build_table(
                    served.columns,
                    [obj],
                    include_object=include_object,
                    resource_version=obj["metadata"].get("resourceVersion", ""),
                    with_headers=first,
                )
                event, first = {"type": event["type"], "object": table}, False
            yield event
