"""Who is asking and may they: bearer-token authentication and RBAC for the embedded API.

Off by default: an :class:`~orchestrator.devcluster.apiserver.EmbeddedApiServer` started
without :class:`AccessControl` checks nothing, as before. Given one, each request is
turned into Kubernetes' request attributes (:func:`attributes_of`: the verb ``get`` /
``list`` / ``watch`` / ``create`` / ``update`` / ``patch`` / ``delete`` /
``deletecollection``, the API group, the resource, the subresource, the namespace and the
name), optionally written to a JSON-lines file (``record_requests``: what a test derives
the operator's RBAC needs from), and, with ``tokens``, authenticated by its bearer token
(an unknown token is 401, and so is a missing one unless ``anonymous`` names who a
request without one is: kubectl sends no bearer token over plain http) and, with
``authorize``, authorized by the
RBAC objects stored in the API (:func:`allowed`), refused with Kubernetes' own 403
``Status`` and message.

RBAC is evaluated as Kubernetes' RBAC authorizer does: the rules of every ClusterRole a
ClusterRoleBinding binds to the user apply everywhere, those of a Role or ClusterRole
a RoleBinding binds apply in the binding's namespace; a rule matches on verb, API group,
resource (``res/sub`` for a subresource, ``*`` and ``*/sub`` as wildcards) and, when it
lists ``resourceNames``, the object's name (so never a ``create`` or a ``list``).
ClusterRole aggregation is not evaluated. What a real cluster grants every user by its
default bindings is granted here too: discovery and health paths (``system:discovery``)
and ``selfsubjectaccessreviews`` (``system:basic-user``); the ``system:masters`` group is
allowed everything and may impersonate (``Impersonate-User``: ``kubectl --as``), as on a
real cluster. ``selfsubjectaccessreviews`` are answered here from the same evaluation,
for the requesting (or impersonated) user, and never stored.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import kmock

from orchestrator.devcluster import errors
from orchestrator.devcluster.resources import ResourceKey, ServedResource
from orchestrator.devcluster.selectors import is_watch

RBAC_GROUP: Final = "rbac.authorization.k8s.io"
AUTHORIZATION_GROUP: Final = "authorization.k8s.io"
ROLES: Final[ResourceKey] = (RBAC_GROUP, "v1", "roles")
CLUSTER_ROLES: Final[ResourceKey] = (RBAC_GROUP, "v1", "clusterroles")
ROLE_BINDINGS: Final[ResourceKey] = (RBAC_GROUP, "v1", "rolebindings")
CLUSTER_ROLE_BINDINGS: Final[ResourceKey] = (RBAC_GROUP, "v1", "clusterrolebindings")
SELF_SUBJECT_ACCESS_REVIEWS: Final[ResourceKey] = (
    AUTHORIZATION_GROUP, "v1", "selfsubjectaccessreviews",
)  # fmt: skip
SELF_REVIEW: Final = (AUTHORIZATION_GROUP, "selfsubjectaccessreviews", "create")
"""Every authenticated user may ask what it may do (Kubernetes' ``system:basic-user``)."""

SUPERUSER_GROUP: Final = "system:masters"
AUTHENTICATED_GROUP: Final = "system:authenticated"


@dataclass(frozen=True)
class User:
    """An authenticated identity: what a token stands for."""

    name: str
    groups: tuple[str, ...] = ()

    @property
    def all_groups(self) -> tuple[str, ...]:
        return (*self.groups, AUTHENTICATED_GROUP)


def service_account_user(namespace: str, name: str) -> User:
    """The user a ServiceAccount's token authenticates as, with the groups Kubernetes
    gives it."""
    return User(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}"),
    )


ANONYMOUS: Final = User("system:anonymous", ("system:unauthenticated",))
"""Who a request is when the server checks no tokens (recorded as such)."""


@dataclass(frozen=True)
class Attributes:
    """Kubernetes' authorization attributes of one resource request."""

    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespace: str = ""
    name: str = ""

    @property
    def resource_path(self) -> str:
        """``resource`` or ``resource/subresource``, as RBAC rules name it."""
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def verb_of(method: str, named: bool, watch: bool) -> str | None:
    """Kubernetes' verb for an HTTP method on a collection (``named`` False) or an object."""
    if method == "GET":
        return "watch" if watch else "get" if named else "list"
    return {
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if named else "deletecollection",
    }.get(method)


def attributes_of(request: kmock.Request) -> Attributes | None:
    """The attributes of a resource request; None for discovery and other paths."""
    if request.resource is None:
        return None
    verb = verb_of(request.method.value, request.name is not None, is_watch(request.params))
    if verb is None:
        return None
    return Attributes(
        verb=verb,
        group=request.resource.group or "",
        resource=request.resource.plural or "",
        subresource=request.subresource or "",
        namespace=request.namespace or "",
        name=request.name or "",
    )


# ------------------------------------------------------------------ RBAC evaluation


def rule_allows(rule: Mapping[str, Any], attrs: Attributes) -> bool:
    """One PolicyRule against the attributes (Kubernetes' ``RuleAllows``)."""
    verbs = rule.get("verbs") or []
    groups = rule.get("apiGroups") or []
    resources = rule.get("resources") or []
    names = rule.get("resourceNames") or []
    if "*" not in verbs and attrs.verb not in verbs:
        return False
    if "*" not in groups and attrs.group not in groups:
        return False
    wanted = attrs.resource_path
    if not (
        "*" in resources
        or wanted in resources
        or (attrs.subresource and f"*/{attrs.subresource}" in resources)
    ):
        return False
    return not names or attrs.name in names


def subject_matches(subject: Mapping[str, Any], user: User, binding_namespace: str) -> bool:
    kind, name = subject.get("kind"), subject.get("name")
    if kind == "User":
        return bool(name == user.name)
    if kind == "Group":
        return name in user.all_groups
    if kind == "ServiceAccount":
        namespace = subject.get("namespace") or binding_namespace
        return user.name == f"system:serviceaccount:{namespace}:{name}"
    return False


@dataclass(frozen=True)
class Policy:
    """The stored RBAC objects, by name: what :func:`allowed` reads."""

    roles: Mapping[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)
    cluster_roles: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    role_bindings: Sequence[Mapping[str, Any]] = ()
    cluster_role_bindings: Sequence[Mapping[str, Any]] = ()

    @classmethod
    def of(
        cls,
        roles: Iterable[Mapping[str, Any]] = (),
        cluster_roles: Iterable[Mapping[str, Any]] = (),
        role_bindings: Iterable[Mapping[str, Any]] = (),
        cluster_role_bindings: Iterable[Mapping[str, Any]] = (),
    ) -> Policy:
        return cls(
            roles={(r["metadata"].get("namespace", ""), r["metadata"]["name"]): r for r in roles},
            cluster_roles={r["metadata"]["name"]: r for r in cluster_roles},
            role_bindings=list(role_bindings),
            cluster_role_bindings=list(cluster_role_bindings),
        )

    def rules_for(self, user: User, namespace: str) -> Iterable[Mapping[str, Any]]:
        """Every rule that applies to ``user`` in ``namespace`` ("" : cluster scope)."""
        for binding in self.cluster_role_bindings:
            if self._binds(binding, user, ""):
                role = self.cluster_roles.get(binding.get("roleRef", {}).get("name", ""))
                yield from (role or {}).get("rules") or []
        if not namespace:
            return
        for binding in self.role_bindings:
            if binding["metadata"].get("namespace") != namespace:
                continue
            if not self._binds(binding, user, namespace):
                continue
            ref = binding.get("roleRef", {})
            role = (
                self.cluster_roles.get(ref.get("name", ""))
                if ref.get("kind") == "ClusterRole"
                else self.roles.get((namespace, ref.get("name", "")))
            )
            yield from (role or {}).get("rules") or []

    @staticmethod
    def _binds(binding: Mapping[str, Any], user: User, namespace: str) -> bool:
        return any(subject_matches(s, user, namespace) for s in binding.get("subjects") or [])


def allowed(policy: Policy, user: User, attrs: Attributes) -> bool:
    """Whether RBAC (plus the default grants, see the module) allows the request."""
    if SUPERUSER_GROUP in user.groups:
        return True
    if (attrs.group, attrs.resource_path, attrs.verb) == SELF_REVIEW:
        return True
    return any(rule_allows(rule, attrs) for rule in policy.rules_for(user, attrs.namespace))


def forbidden_message(user: User, attrs: Attributes) -> str:
    """Kubernetes' message for a request RBAC refused, word for word."""
    qualified = f"{attrs.resource}.{attrs.group}" if attrs.group else attrs.resource
    subject = f'{qualified} "{attrs.name}"' if attrs.name else qualified
    scope = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
    return (
        f'{subject} is forbidden: User "{user.name}" cannot {attrs.verb} resource '
        f'"{attrs.resource_path}" in API group "{attrs.group}" {scope}'
    )


def forbidden(user: User, attrs: Attributes) -> kmock.KubernetesError:
    details = {"name": attrs.name, "group": attrs.group, "kind": attrs.resource}
    if not attrs.name:
        del details["name"]
    return errors.api_error(403, "Forbidden", forbidden_message(user, attrs), details)


def unauthorized() -> kmock.KubernetesError:
    return errors.api_error(401, "Unauthorized", "Unauthorized")


# ------------------------------------------------------------------ served resources


def served_resources() -> list[ServedResource]:
    """The endpoints this module adds to the embedded API's built-ins."""

    def rbac(plural: str, kind: str, namespaced: bool) -> ServedResource:
        return ServedResource(RBAC_GROUP, "v1", plural, kind, kind.lower(), namespaced=namespaced)

    return [
        rbac("roles", "Role", True),
        rbac("clusterroles", "ClusterRole", False),
        rbac("rolebindings", "RoleBinding", True),
        rbac("clusterrolebindings", "ClusterRoleBinding", False),
        ServedResource("", "v1", "serviceaccounts", "ServiceAccount", "serviceaccount",
                       namespaced=True, short_names=("sa",)),
        ServedResource(AUTHORIZATION_GROUP, "v1", "selfsubjectaccessreviews",
                       "SelfSubjectAccessReview", "selfsubjectaccessreview", namespaced=False,
                       verbs=("create",)),
    ]  # fmt: skip


def review_attributes(body: Any) -> Attributes:
    """The attributes a SelfSubjectAccessReview asks about (400 when it names none)."""
    spec = body.get("spec") if isinstance(body, Mapping) else None
    asked = spec.get("resourceAttributes") if isinstance(spec, Mapping) else None
    if not isinstance(asked, Mapping):
        raise errors.bad_request(
            "SelfSubjectAccessReview: spec.resourceAttributes is required "
            "(nonResourceAttributes are not supported by the embedded API server)"
        )
    return Attributes(
        verb=str(asked.get("verb") or ""),
        group=str(asked.get("group") or ""),
        resource=str(asked.get("resource") or ""),
        subresource=str(asked.get("subresource") or ""),
        namespace=str(asked.get("namespace") or ""),
        name=str(asked.get("name") or ""),
    )


def review_answer(body: Mapping[str, Any], allowed_: bool, reason: str) -> dict[str, Any]:
    status: dict[str, Any] = {"allowed": allowed_}
    if reason:
        status["reason"] = reason
    return {
        "apiVersion": f"{AUTHORIZATION_GROUP}/v1",
        "kind": "SelfSubjectAccessReview",
        "metadata": {"creationTimestamp": None},
        "spec": dict(body.get("spec") or {}),
        "status": status,
    }


# ------------------------------------------------------------------ the server's side


@dataclass(frozen=True)
class RecordedRequest:
    """One line of the request record."""

    user: str
    verb: str
    group: str
    resource: str
    subresource: str
    namespace: str
    name: str
    allowed: bool


class AccessControl:
    """What the embedded API checks and records; see the module. ``tokens``: bearer token
    → user (empty: no authentication, every request is :data:`ANONYMOUS` and allowed);
    ``authorize``: RBAC on (needs ``tokens``); ``record_requests``: a JSON-lines file."""

    def __init__(
        self,
        tokens: Mapping[str, User] | None = None,
        *,
        authorize: bool = False,
        record_requests: Path | None = None,
        anonymous: User | None = None,
    ) -> None:
        if authorize and not tokens:
            raise ValueError("RBAC authorization needs tokens to tell users apart")
        self.tokens = dict(tokens or {})
        self.anonymous = anonymous
        self.authorize = authorize
        self.record_requests = record_requests
        self._lock = threading.Lock()

    def authenticate(self, headers: Mapping[str, str]) -> User:
        """The user of a request's ``Authorization: Bearer`` header (401 when unknown),
        or ``anonymous`` for a request without one (401 when None); then, for a
        ``system:masters`` user, the user an ``Impersonate-User`` header names
        (``kubectl --as``)."""
        if not self.tokens:
            return ANONYMOUS
        value = _header(headers, "authorization")
        scheme, _, token = value.partition(" ")
        user = self.tokens.get(token.strip()) if scheme.lower() == "bearer" else None
        if not value and self.anonymous is not None:
            user = self.anonymous
        if user is None:
            raise unauthorized()
        return impersonated(user, headers)

    def decide(self, policy: Policy, user: User, attrs: Attributes) -> bool:
        return not self.authorize or allowed(policy, user, attrs)

    def record(self, user: User, attrs: Attributes, allowed_: bool) -> None:
        if self.record_requests is None:
            return
        line = json.dumps(asdict(RecordedRequest(user.name, **asdict(attrs), allowed=allowed_)))
        with self._lock, self.record_requests.open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")


def _header(headers: Mapping[str, str], name: str) -> str:
    return next((v for k, v in headers.items() if k.lower() == name), "")


def impersonated(user: User, headers: Mapping[str, str]) -> User:
    """The user ``Impersonate-User`` names (with ``Impersonate-Group``, or a
    ServiceAccount's own groups), when ``user`` may impersonate: ``system:masters`` only."""
    name = _header(headers, "impersonate-user")
    if not name:
        return user
    if SUPERUSER_GROUP not in user.groups:
        attrs = Attributes("impersonate", "", "users", name=name)
        raise forbidden(user, attrs)
    groups = tuple(g for g in [_header(headers, "impersonate-group")] if g)
    prefix = "system:serviceaccount:"
    if not groups and name.startswith(prefix) and name.count(":") == 3:
        namespace, account = name.removeprefix(prefix).split(":")
        return service_account_user(namespace, account)
    return User(name, groups)


def read_record(path: Path) -> list[RecordedRequest]:
    """The requests a server recorded in ``path``."""
    return [
        RecordedRequest(**json.loads(line))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
