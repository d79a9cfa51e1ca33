"""RBAC as the embedded API evaluates it (``orchestrator.devcluster.authz``), against the
rules Kubernetes' RBAC authorizer applies; and the operator's permission check
(``orchestrator.operator.permissions``) answered by that evaluation."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchestrator.devcluster import authz
from orchestrator.devcluster.authz import Attributes, Policy, User
from orchestrator.operator import permissions

OPERATOR = authz.service_account_user("caliban-drain", "caliban-drain-operator")
GROUP = "caliban.caliban-ai.dev"


def cluster_role(name: str, *rules: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "rules": list(rules)}


def binding(
    role_kind: str, role: str, *subjects: dict[str, Any], namespace: str = ""
) -> dict[str, Any]:
    meta = {"name": f"{role}-binding"} | ({"namespace": namespace} if namespace else {})
    return {"metadata": meta, "roleRef": {"kind": role_kind, "name": role}, "subjects": [*subjects]}


SA_SUBJECT = {
    "kind": "ServiceAccount",
    "name": "caliban-drain-operator",
    "namespace": "caliban-drain",
}


@pytest.mark.parametrize(
    ("rule", "attrs", "allowed"),
    [
        ({"apiGroups": [GROUP], "resources": ["calibantasks"], "verbs": ["patch"]},
         Attributes("patch", GROUP, "calibantasks"), True),
        ({"apiGroups": [GROUP], "resources": ["calibantasks"], "verbs": ["patch"]},
         Attributes("patch", GROUP, "calibantasks", "status"), False),
        ({"apiGroups": [GROUP], "resources": ["calibantasks/status"], "verbs": ["patch"]},
         Attributes("patch", GROUP, "calibantasks", "status"), True),
        ({"apiGroups": [GROUP], "resources": ["*/status"], "verbs": ["patch"]},
         Attributes("patch", GROUP, "calibantasks", "status"), True),
        ({"apiGroups": [GROUP], "resources": ["*"], "verbs": ["get"]},
         Attributes("get", GROUP, "calibantasks", "status"), True),
        ({"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
         Attributes("watch", "", "pods"), False),
        ({"apiGroups": ["*"], "resources": ["pods"], "verbs": ["*"]},
         Attributes("deletecollection", "", "pods"), True),
        ({"apiGroups": ["policy"], "resources": ["pods"], "verbs": ["list"]},
         Attributes("list", "", "pods"), False),
        ({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"],
          "resourceNames": ["caliban-drain-broker"]},
         Attributes("get", "", "secrets", name="caliban-drain-broker"), True),
        ({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"],
          "resourceNames": ["caliban-drain-broker"]},
         Attributes("get", "", "secrets", name="other"), False),
        ({"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "list"],
          "resourceNames": ["caliban-drain-broker"]},
         Attributes("create", "", "secrets"), False),
        ({"apiGroups": [""], "resources": ["secrets"], "verbs": ["list"],
          "resourceNames": ["caliban-drain-broker"]},
         Attributes("list", "", "secrets"), False),
    ],
    ids=["exact", "subresource-not-by-parent", "subresource", "star-subresource",
         "star-resource-any-subresource", "other-verb", "stars", "other-group", "named",
         "other-name", "create-never-by-name", "list-never-by-name"],
)  # fmt: skip
def test_a_rule_matches_as_kubernetes_rbac_does(
    rule: dict[str, Any], attrs: Attributes, allowed: bool
) -> None:
    assert authz.rule_allows(rule, attrs) is allowed


def test_a_cluster_role_binding_grants_everywhere_and_only_to_its_subjects() -> None:
    policy = Policy.of(
        cluster_roles=[
            cluster_role("op", {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]})
        ],
        cluster_role_bindings=[binding("ClusterRole", "op", SA_SUBJECT)],
    )
    assert authz.allowed(policy, OPERATOR, Attributes("list", "", "pods", namespace="team-a"))
    assert authz.allowed(policy, OPERATOR, Attributes("list", "", "pods"))
    other = authz.service_account_user("default", "caliban-drain-operator")
    assert not authz.allowed(policy, other, Attributes("list", "", "pods", namespace="team-a"))


def test_a_role_binding_grants_only_in_its_namespace_even_for_a_cluster_role() -> None:
    rules = {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}
    policy = Policy.of(
        roles=[{"metadata": {"name": "r", "namespace": "team-a"}, "rules": [rules]}],
        cluster_roles=[cluster_role("c", rules)],
        role_bindings=[
            binding("Role", "r", {"kind": "User", "name": "alice"}, namespace="team-a"),
            binding("ClusterRole", "c", {"kind": "Group", "name": "devs"}, namespace="team-b"),
        ],
    )
    alice, bob = User("alice"), User("bob", ("devs",))
    assert authz.allowed(policy, alice, Attributes("list", "", "pods", namespace="team-a"))
    assert not authz.allowed(policy, alice, Attributes("list", "", "pods", namespace="team-b"))
    assert not authz.allowed(policy, alice, Attributes("list", "", "pods"))
    assert authz.allowed(policy, bob, Attributes("list", "", "pods", namespace="team-b"))
    assert not authz.allowed(policy, bob, Attributes("list", "", "pods", namespace="team-a"))


def test_a_service_account_subject_without_namespace_is_the_bindings_own() -> None:
    subject = {"kind": "ServiceAccount", "name": "caliban-drain-operator"}
    assert authz.subject_matches(subject, OPERATOR, "caliban-drain")
    assert not authz.subject_matches(subject, OPERATOR, "default")


def test_service_accounts_and_authenticated_users_match_their_groups() -> None:
    assert authz.subject_matches({"kind": "Group", "name": "system:serviceaccounts"}, OPERATOR, "")
    assert authz.subject_matches({"kind": "Group", "name": "system:authenticated"}, OPERATOR, "")
    assert not authz.subject_matches(
        {"kind": "User", "name": "caliban-drain-operator"}, OPERATOR, ""
    )


def test_masters_may_do_anything_and_anyone_may_review_themselves() -> None:
    empty = Policy.of()
    assert authz.allowed(
        empty, User("admin", ("system:masters",)), Attributes("delete", "", "nodes")
    )
    assert authz.allowed(
        empty,
        User("nobody"),
        Attributes("create", "authorization.k8s.io", "selfsubjectaccessreviews"),
    )
    assert not authz.allowed(empty, User("nobody"), Attributes("get", "", "pods", namespace="x"))


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        (Attributes("patch", GROUP, "calibantasks", "status", "ns", "t1"),
         'calibantasks.caliban.caliban-ai.dev "t1" is forbidden: User '
         '"system:serviceaccount:caliban-drain:caliban-drain-operator" cannot patch resource '
         '"calibantasks/status" in API group "caliban.caliban-ai.dev" in the namespace "ns"'),
        (Attributes("list", "", "pods"),
         'pods is forbidden: User "system:serviceaccount:caliban-drain:caliban-drain-operator" '
         'cannot list resource "pods" in API group "" at the cluster scope'),
    ],
    ids=["named-namespaced", "collection-cluster"],
)  # fmt: skip
def test_a_refusal_reads_as_kubernetes_words_it(attrs: Attributes, message: str) -> None:
    error = authz.forbidden(OPERATOR, attrs)
    assert (error.status, error.reason, error.message) == (403, "Forbidden", message)


@pytest.mark.parametrize(
    ("method", "named", "watch", "verb"),
    [("GET", True, False, "get"), ("GET", False, False, "list"), ("GET", False, True, "watch"),
     ("POST", False, False, "create"), ("PUT", True, False, "update"),
     ("PATCH", True, False, "patch"), ("DELETE", True, False, "delete"),
     ("DELETE", False, False, "deletecollection")],
)  # fmt: skip
def test_http_methods_map_to_kubernetes_verbs(
    method: str, named: bool, watch: bool, verb: str
) -> None:
    assert authz.verb_of(method, named, watch) == verb


def test_authorization_without_tokens_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="needs tokens"):
        authz.AccessControl(authorize=True)


# ------------------------------------------------------------ the operator's startup check


def review_by(policy: Policy) -> permissions.Review:
    def review(asked: Any) -> bool:
        return authz.allowed(
            policy, OPERATOR, authz.review_attributes({"spec": {"resourceAttributes": asked}})
        )

    return review


def test_the_full_permissions_pass_the_startup_check() -> None:
    policy = Policy.of(
        cluster_roles=[cluster_role("op", *(p.rule() for p in permissions.PERMISSIONS))],
        cluster_role_bindings=[binding("ClusterRole", "op", SA_SUBJECT)],
    )
    every = list(permissions.Need)
    assert permissions.missing_permissions(permissions.active(every), review_by(policy)) == []


def test_a_renamed_broker_secret_is_asked_for_by_its_configured_name() -> None:
    policy = Policy.of(
        cluster_roles=[cluster_role("op", *(p.rule() for p in permissions.PERMISSIONS))],
        cluster_role_bindings=[binding("ClusterRole", "op", SA_SUBJECT)],
    )
    with pytest.raises(permissions.MissingPermissions) as caught:
        permissions.check_startup(
            [permissions.Need.MANAGE_SANDBOX], review_by(policy), broker_secret="renamed"
        )
    assert caught.value.missing == [
        'get secrets named "renamed" (core) cluster-wide',
        'patch secrets named "renamed" (core) cluster-wide',
    ]


def test_only_what_the_configuration_uses_is_checked() -> None:
    needs = permissions.needs_of(manage_sandbox=False, snapshots=True, peering=False)
    assert {p.need for p in permissions.active(needs)} == {permissions.Need.ALWAYS}
    needs = permissions.needs_of(manage_sandbox=True, snapshots=False, peering=True)
    assert permissions.Need.SNAPSHOTS not in needs and permissions.Need.PEERING in needs
    assert permissions.Need.WORKSPACE_STATUS not in needs
    needs = permissions.needs_of(
        manage_sandbox=True, snapshots=True, peering=False, workspace_status=True
    )
    assert [
        p.resource for p in permissions.active(needs) if p.need is permissions.Need.WORKSPACE_STATUS
    ] == ["workspaces/status"]


def test_a_missing_verb_is_named_in_one_line() -> None:
    rules = [p.rule() for p in permissions.PERMISSIONS if p.resource != "calibantasks/status"]
    policy = Policy.of(
        cluster_roles=[cluster_role("op", *rules)],
        cluster_role_bindings=[binding("ClusterRole", "op", SA_SUBJECT)],
    )
    with pytest.raises(permissions.MissingPermissions) as caught:
        permissions.check_startup([permissions.Need.ALWAYS], review_by(policy))
    assert str(caught.value) == (
        "the operator lacks RBAC permission: patch calibantasks/status "
        "(caliban.caliban-ai.dev) cluster-wide; see deploy/base/rbac.yaml"
    )


def _api_error(status: int, body: dict[str, Any]) -> Exception:
    from kubernetes.client.exceptions import ApiException

    error: Exception = ApiException(status=status, reason="Forbidden")
    error.body = json.dumps(body)  # type: ignore[attr-defined]
    return error


TERMINATING_REFUSAL = {
    "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403, "reason": "Forbidden",
    "message": 'poddisruptionbudgets.policy "t-drain-guard" is forbidden: unable to create new '
               "content in namespace team-x because it is being terminated",
    "details": {"name": "t-drain-guard", "group": "policy", "kind": "poddisruptionbudgets",
                "causes": [{"reason": "NamespaceTerminating", "field": "metadata.namespace",
                            "message": "namespace team-x is being terminated"}]},
}  # fmt: skip
RBAC_REFUSAL = {
    "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403, "reason": "Forbidden",
    "message": 'poddisruptionbudgets.policy is forbidden: User "system:serviceaccount:caliban-'
               'drain:caliban-drain-operator" cannot create resource "poddisruptionbudgets" in '
               'API group "policy" in the namespace "team-x"',
}  # fmt: skip


@pytest.mark.parametrize(
    ("body", "terminating"),
    [
        (TERMINATING_REFUSAL, True),
        ({**TERMINATING_REFUSAL, "details": {}}, True),  # a server that gives no cause
        ({**TERMINATING_REFUSAL, "message": "forbidden", "details": TERMINATING_REFUSAL["details"]},
         True),
        (RBAC_REFUSAL, False),
    ],
    ids=["with-cause", "message-only", "cause-only", "rbac"],
)  # fmt: skip
def test_a_create_refused_in_a_terminating_namespace_is_not_a_missing_permission(
    body: dict[str, Any], terminating: bool
) -> None:
    refused = _api_error(403, body)
    assert permissions.refused_as_terminating(refused) is terminating
    named = permissions.forbidden_permission(refused)
    assert named == (None if terminating else RBAC_REFUSAL["message"])
    assert not permissions.refused_as_terminating(_api_error(404, TERMINATING_REFUSAL))
