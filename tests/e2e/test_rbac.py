"""The operator's RBAC, proved against the code: ``deploy/base/rbac.yaml`` as kustomize
renders it grants every call the operator makes, and nothing it does not make.

The calls come from a recorded run, never from a copy of the Role: ``drainctl demo``'s
whole story (provision with ``--manage-sandbox``, run, idle pause with a snapshot, wake,
delete with a drain, restore from the checkpoint) on a dev stack started with
``--rbac`` (the embedded API authorizes by the rendered RBAC objects, the operator runs
as its ServiceAccount) and ``--record-requests`` (every request's user, verb, group and
resource, as Kubernetes names them), with a Workspace for the operator to write the status
of. The second half starts a real ``drainctl operator``
against the embedded API with authorization on and a ClusterRole missing one verb.
"""

from __future__ import annotations

import copy
import os
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from orchestrator.demo.story import NAMESPACE, RESTORED, Story
from orchestrator.devcluster import authz
from orchestrator.devcluster.apiserver import EmbeddedApiServer, load_crds
from orchestrator.devcluster.kubeconfig import write_kubeconfig
from orchestrator.devcluster.up import (
    OPERATOR_TOKEN,
    OPERATOR_USER,
    apply_manifests,
    packaged_crds,
    stack_access,
)
from orchestrator.operator import crd, permissions
from orchestrator.settings import Settings
from tests.support import LoopThread, wait_until
from worker_agent.testing import DRAINCTL, WaitTimeout

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")

Call = tuple[str, str, str, str]  # (group, resource[/subresource], verb, name)


def rendered_rbac() -> list[dict[str, Any]]:
    """The RBAC objects of ``kubectl kustomize deploy/base``: what a cluster gets."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(REPO / "deploy" / "base")],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    return [d for d in yaml.safe_load_all(rendered) if d and d.get("kind") in kinds]


def operator_role(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (role,) = [
        o for o in objects
        if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "caliban-drain-operator"
    ]  # fmt: skip
    return role


def granted(rules: list[dict[str, Any]], call: Call) -> bool:
    group, path, verb, name = call
    resource, _, subresource = path.partition("/")
    attrs = authz.Attributes(verb, group, resource, subresource, name=name)
    return any(authz.rule_allows(rule, attrs) for rule in rules)


def rbac_problems(rules: list[dict[str, Any]], calls: set[Call]) -> list[str]:
    """What is wrong with ``rules`` against the recorded ``calls``: a call not granted, a
    wildcard, a granted (group, resource, verb) that is neither called nor justified in
    ``permissions.UNREACHED``."""
    problems = [f"not granted: {c}" for c in sorted(calls) if not granted(rules, c)]
    used = {call[:3] for call in calls}
    for rule in rules:
        for key in ("apiGroups", "resources", "verbs", "resourceNames"):
            if any("*" in value for value in rule.get(key, [])):
                problems.append(f"wildcard in {key}: {rule}")
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for verb in rule.get("verbs", []):
                    use = (group, resource, verb)
                    if use not in used and use not in permissions.UNREACHED:
                        problems.append(f"granted but never used: {use}")
    return problems


def sandbox_deleted_under_its_task(story: Story) -> None:
    """One more path past the story: the restored task's Sandbox deleted under it; the
    operator re-creates it once no pod still mounts the workspace (``last_pod_on``)."""
    sandboxes = (
        crd.SANDBOX_GROUP,
        "v1alpha1",
        NAMESPACE,
        crd.SANDBOX_PLURAL,
        crd.sandbox_name(RESTORED),
    )
    old = story.custom().get_namespaced_custom_object(*sandboxes)
    story.custom().delete_namespaced_custom_object(*sandboxes)

    def recreated() -> bool:
        try:
            found = story.custom().get_namespaced_custom_object(*sandboxes)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return bool(found["metadata"]["uid"] != old["metadata"]["uid"])

    # The old pod may take its whole termination grace (its daemon draining) before it
    # lets the workspace go; then a heartbeat's silence and a pass.
    grace = old["spec"]["podTemplate"]["spec"]["terminationGracePeriodSeconds"]
    try:
        wait_until(recreated, timeout=grace + 60, what="the deleted Sandbox to be re-created")
    except WaitTimeout as exc:
        status = (story.task(RESTORED) or {}).get("status") or {}
        assert story.stack is not None
        log = (story.stack.state / "logs" / "operator.log").read_text().splitlines()
        warnings = [line for line in log if "level=WARNING" in line][-10:]
        raise WaitTimeout(f"{exc}; the task's status: {status}; the operator's last "
                          f"warnings: {warnings}") from None  # fmt: skip


def workspace_given_its_status(story: Story) -> None:
    """One more path: a Workspace, whose status the operator writes (``--manage-sandbox``
    with ``DRAIN_WORKSPACE_STATUS`` at its default)."""
    workspaces = (crd.GROUP, crd.VERSION, NAMESPACE, crd.WORKSPACE_PLURAL)
    story.custom().create_namespaced_custom_object(*workspaces, {
        "apiVersion": crd.API_VERSION, "kind": crd.WORKSPACE_KIND,
        "metadata": {"name": "team-a-ws", "namespace": NAMESPACE},
        "spec": {"displayName": "Team A",
                 "sources": [{"name": "app", "repo": "file:///srv/app.git", "path": "/work/app"}],
                 "providers": [{"name": "workers", "kind": "ollama", "model": "m"}]},
    })  # fmt: skip

    def ready() -> bool:
        found = story.custom().get_namespaced_custom_object(*workspaces, "team-a-ws")
        return bool((found.get("status") or {}).get("phase") == "Ready")

    wait_until(ready, timeout=60, what="the Workspace's status")


SNAPSHOT_READY_DELAY_SECS = 2 * Settings().snapshot_follow_interval_secs


@dataclass(frozen=True)
class RecordedRun:
    rules: list[dict[str, Any]]
    calls: set[Call]
    refused: list[authz.RecordedRequest]


def operator_calls(record: Path) -> tuple[set[Call], list[authz.RecordedRequest]]:
    """The operator's calls in a request record, and those refused."""
    mine = [r for r in authz.read_record(record) if r.user == OPERATOR_USER.name]
    calls = {
        (r.group, f"{r.resource}/{r.subresource}" if r.subresource else r.resource, r.verb,
         r.name)
        for r in mine
        if (r.group, r.resource, r.verb) != authz.SELF_REVIEW  # every user's (basic-user)
    }  # fmt: skip
    return calls, [r for r in mine if not r.allowed]


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory: pytest.TempPathFactory) -> RecordedRun:
    """The demo's story on a dev stack authorizing by the rendered RBAC, recorded."""
    root = tmp_path_factory.mktemp("rbac-run")
    objects = rendered_rbac()
    rbac_file = root / "rbac.yaml"
    rbac_file.write_text(yaml.safe_dump_all(objects))
    record = root / "requests.jsonl"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    # Snapshots ready only after the follower's first look (its interval, 5 s, and a
    # margin): with a driver that readies them at once, the operator's own passes may
    # settle every snapshot before the follower looks, and its list is never made.
    story = Story(root, 2, port, None, "--rbac", str(rbac_file), "--record-requests", str(record),
                  "--snapshot-ready-delay", str(SNAPSHOT_READY_DELAY_SECS))  # fmt: skip
    try:
        story.run()
        sandbox_deleted_under_its_task(story)
        workspace_given_its_status(story)
    finally:
        story.stop()
    assert story.lost_turns() == 0
    calls, refused = operator_calls(record)
    return RecordedRun(operator_role(objects)["rules"], calls, refused)


class ApiThread:
    """The embedded API with RBAC on, on its own event-loop thread."""

    def __init__(self, record: Path, crds: list[dict[str, Any]] | None = None) -> None:
        self._loop = LoopThread("rbac-api")
        access = stack_access(True, record)  # as drainctl dev up --rbac has it
        self.server = EmbeddedApiServer(
            crds=packaged_crds() if crds is None else crds, access=access
        )
        self._loop.run(self.server.start())

    def admin_client(self, root: Path) -> client.ApiClient:
        """A client as the dev user (``system:masters``), also made the default one."""
        kubeconfig = write_kubeconfig(root / "admin.kubeconfig", self.server.url)
        config.load_kube_config(config_file=str(kubeconfig))
        return config.new_client_from_config(config_file=str(kubeconfig))

    def apply(self, root: Path, objects: list[dict[str, Any]]) -> None:
        rbac = root / "rbac.yaml"
        rbac.write_text(yaml.safe_dump_all(objects))
        apply_manifests(rbac)

    def close(self) -> None:
        self._loop.run(self.server.stop())
        self._loop.close()


def operator_environment(root: Path, api_url: str) -> dict[str, str]:
    """The operator as its ServiceAccount, on a ledger and broker it does not reach here."""
    kubeconfig = write_kubeconfig(root / "operator.kubeconfig", api_url, token=OPERATOR_TOKEN)
    environment = {
        k: v for k, v in os.environ.items() if not k.startswith("DRAIN_") and k != "KUBECONFIG"
    }
    environment.update({
        "KUBECONFIG": str(kubeconfig),
        "DRAIN_DATABASE_URL": f"sqlite:///{root / 'ledger.db'}",
        "DRAIN_BROKER_URL": "redis://127.0.0.1:9/0",
        "DRAIN_METRICS_PORT": "0",
    })  # fmt: skip
    return environment


@pytest.fixture(scope="module")
def peering_run(tmp_path_factory: pytest.TempPathFactory) -> RecordedRun:
    """``drainctl operator --peering caliban-drain`` under the rendered RBAC until its
    keep-alive is in the ClusterKopfPeering, then stopped (its keep-alive withdrawn)."""
    root = tmp_path_factory.mktemp("rbac-peering")
    objects = rendered_rbac()
    peering_crds = load_crds([REPO / "orchestrator" / "operator" / "crds" / "kopf-peering.yaml"])
    api = ApiThread(root / "requests.jsonl", [*packaged_crds(), *peering_crds])
    try:
        admin = client.CustomObjectsApi(api.admin_client(root))
        api.apply(root, objects)
        peerings = ("kopf.dev", "v1", "clusterkopfpeerings")
        admin.create_cluster_custom_object(*peerings, {
            "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
            "metadata": {"name": "caliban-drain"},
        })  # fmt: skip
        log = root / "operator.log"
        with log.open("w") as stderr:
            operator = subprocess.Popen(
                [*DRAINCTL, "operator", "--peering", "caliban-drain"],
                stdout=subprocess.DEVNULL, stderr=stderr,
                env=operator_environment(root, api.server.url),
            )  # fmt: skip
        try:

            def keep_alive_written() -> bool:
                assert operator.poll() is None, log.read_text()[-2000:]
                found = admin.get_cluster_custom_object(*peerings, "caliban-drain")
                return bool(found.get("status"))

            wait_until(keep_alive_written, timeout=60, what="the operator's keep-alive")
        finally:
            operator.terminate()
            operator.wait(timeout=60)
        calls, refused = operator_calls(root / "requests.jsonl")
        return RecordedRun(operator_role(objects)["rules"], calls, refused)
    finally:
        api.close()


@pytest.mark.slow
def test_the_whole_story_runs_under_the_rendered_rbac_without_one_refusal(
    recorded_run: RecordedRun,
) -> None:
    assert ("caliban.caliban-ai.dev", "calibantasks/status", "patch", "demo-story") in (
        recorded_run.calls
    )
    assert ("caliban.caliban-ai.dev", "workspaces/status", "patch", "team-a-ws") in (
        recorded_run.calls
    )
    assert recorded_run.refused == []


@pytest.mark.slow
def test_a_peering_operator_runs_under_the_rendered_rbac_without_one_refusal(
    peering_run: RecordedRun,
) -> None:
    assert ("kopf.dev", "clusterkopfpeerings", "patch", "caliban-drain") in peering_run.calls
    assert peering_run.refused == []


@pytest.mark.slow
def test_every_call_the_operator_made_is_granted_and_every_grant_is_used_or_justified(
    recorded_run: RecordedRun, peering_run: RecordedRun
) -> None:
    """The calls of both runs against the rendered ClusterRole: each granted, and each
    granted verb made by one of them or justified in ``permissions.UNREACHED``."""
    calls = recorded_run.calls | peering_run.calls
    assert rbac_problems(recorded_run.rules, calls) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        ({"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]}, "wildcard in verbs"),
        ({"apiGroups": [""], "resources": ["*"], "verbs": ["get"]}, "wildcard in resources"),
        ({"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]},
         "granted but never used: ('', 'configmaps', 'get')"),
        ({"apiGroups": ["caliban.caliban-ai.dev"], "resources": ["calibantasks"],
          "verbs": ["delete"]},
         "granted but never used: ('caliban.caliban-ai.dev', 'calibantasks', 'delete')"),
    ],
    ids=["verb-star", "resource-star", "unused-resource", "unused-verb"],
)  # fmt: skip
def test_a_role_edited_to_grant_a_wildcard_or_an_unused_rule_fails_the_check(
    recorded_run: RecordedRun, peering_run: RecordedRun, edit: dict[str, Any], problem: str
) -> None:
    """Tried: the rendered ClusterRole edited to grant ``*`` (verb or resource) or a rule
    the code never uses; the check names it."""
    rules = [*copy.deepcopy(recorded_run.rules), edit]
    found = rbac_problems(rules, recorded_run.calls | peering_run.calls)
    assert any(problem in line for line in found), found


def test_the_cluster_role_holds_exactly_the_rules_of_permissions_py() -> None:
    role = operator_role(rendered_rbac())
    assert role["rules"] == [p.rule() for p in permissions.PERMISSIONS]


def test_the_worker_and_flower_have_no_token_and_no_binding() -> None:
    objects = rendered_rbac()
    accounts = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceAccount"}
    assert set(accounts) == {
        "caliban-drain-operator", "caliban-drain-worker", "caliban-drain-flower",
    }  # fmt: skip
    for name in ("caliban-drain-worker", "caliban-drain-flower"):
        assert accounts[name]["automountServiceAccountToken"] is False
    subjects = [s["name"] for o in objects if o["kind"].endswith("Binding") for s in o["subjects"]]
    assert subjects == ["caliban-drain-operator"]


# ------------------------------------------------------------ a ClusterRole missing a verb


@pytest.fixture
def rbac_api(tmp_path: Path) -> Iterator[ApiThread]:
    api = ApiThread(tmp_path / "requests.jsonl")
    try:
        yield api
    finally:
        api.close()


def without_verb(objects: list[dict[str, Any]], resource: str, verb: str) -> list[dict[str, Any]]:
    edited = copy.deepcopy(objects)
    for rule in operator_role(edited)["rules"]:
        if rule["resources"] == [resource]:
            rule["verbs"].remove(verb)
    return edited


@pytest.mark.parametrize(
    ("resource", "verb", "named"),
    [
        ("calibantasks/status", "patch",
         "patch calibantasks/status (caliban.caliban-ai.dev) cluster-wide"),
        ("persistentvolumeclaims", "create", "create persistentvolumeclaims (core) cluster-wide"),
    ],
    ids=["status-patch", "pvc-create"],
)  # fmt: skip
def test_an_operator_whose_cluster_role_misses_a_verb_exits_naming_it(
    rbac_api: ApiThread, tmp_path: Path, resource: str, verb: str, named: str
) -> None:
    """Tried: the rendered ClusterRole with one verb removed; the real operator process,
    authorization on, stops at startup with one line naming the permission (no retry
    loop, no traceback)."""
    rbac_api.admin_client(tmp_path)
    rbac_api.apply(tmp_path, without_verb(rendered_rbac(), resource, verb))
    result = subprocess.run(
        [*DRAINCTL, "operator", "--manage-sandbox"], capture_output=True, text=True,
        env=operator_environment(tmp_path, rbac_api.server.url), timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [
        f"Error: the operator lacks RBAC permission: {named}; see deploy/base/rbac.yaml"
    ]
    assert "Traceback" not in result.stderr


def test_a_permission_withdrawn_at_runtime_is_logged_and_evented_naming_it(
    rbac_api: ApiThread, tmp_path: Path
) -> None:
    """Tried: the ClusterRole loses ``create`` on Sandboxes after the operator started
    (its startup check passed); provisioning a task is refused, and the operator says
    which permission it lacks in its log and in a Warning event on the task."""
    from orchestrator.ledger.migrate import upgrade

    admin = rbac_api.admin_client(tmp_path)
    objects = rendered_rbac()
    rbac_api.apply(tmp_path, objects)
    env = operator_environment(tmp_path, rbac_api.server.url)
    upgrade(env["DRAIN_DATABASE_URL"])
    log = tmp_path / "operator.log"
    with log.open("w") as stderr:
        operator = subprocess.Popen(
            [*DRAINCTL, "operator", "--manage-sandbox"],
            stdout=subprocess.DEVNULL, stderr=stderr, env=env,
        )  # fmt: skip
    try:
        wait_until(lambda: "rbac_checked" in log.read_text(), timeout=60, what="the check")
        rbac = client.RbacAuthorizationV1Api(admin)
        role = operator_role(without_verb(objects, crd.SANDBOX_PLURAL, "create"))
        rbac.replace_cluster_role("caliban-drain-operator", role)
        client.CustomObjectsApi(admin).create_namespaced_custom_object(
            crd.GROUP, crd.VERSION, "default", crd.PLURAL,
            {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "t1"},
             "spec": {"task": {"agents": 1, "provider": "scripted", "model": "turns=1",
                               "prompt": "one turn"}}},
        )  # fmt: skip
        expected = (
            # A server-side apply that creates is authorized as a create of that name.
            'the operator lacks RBAC permission: sandboxes.agents.x-k8s.io "t1-sbx" is '
            "forbidden: "
            'User "system:serviceaccount:caliban-drain:caliban-drain-operator" cannot create '
            'resource "sandboxes" in API group "agents.x-k8s.io" in the namespace "default"; '
            "see deploy/base/rbac.yaml"
        )

        def warned() -> bool:
            events = client.CoreV1Api(admin).list_namespaced_event("default").items
            return any(e.reason == "Forbidden" and e.message == expected for e in events)

        wait_until(warned, timeout=60, what="the Forbidden event")
        assert expected in log.read_text()
    finally:
        operator.terminate()
        operator.wait(timeout=60)


# ------------------------------------------------------------ the embedded API, with kubectl


def kubectl(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_kubectl_applies_the_rbac_file_and_the_api_answers_by_it(
    rbac_api: ApiThread, tmp_path: Path
) -> None:
    """The real kubectl: ``apply -f deploy/base/rbac.yaml`` as the admin, then as the
    operator's ServiceAccount (``--as``, impersonated) ``auth can-i``
    (SelfSubjectAccessReviews) and a refused request with Kubernetes' message; every
    request recorded with its verb. kubectl sends no token over http: it is the dev
    stack's anonymous admin."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    admin = write_kubeconfig(tmp_path / "admin.kubeconfig", rbac_api.server.url)
    assert kubectl(admin, "create", "namespace", "caliban-drain").returncode == 0
    applied = kubectl(admin, "apply", "-f", str(REPO / "deploy" / "base" / "rbac.yaml"))
    assert applied.returncode == 0, applied.stderr
    assert "clusterrole.rbac.authorization.k8s.io/caliban-drain-operator created" in applied.stdout
    can = [
        ("patch", "calibantasks.caliban.caliban-ai.dev", "--subresource=status", "yes"),
        ("watch", "calibantasks.caliban.caliban-ai.dev", "", "yes"),
        ("delete", "calibantasks.caliban.caliban-ai.dev", "", "no"),
        ("list", "secrets", "", "no"),
        ("get", "secrets/caliban-drain-broker", "", "yes"),
        ("get", "secrets/other", "", "no"),
    ]
    for verb, what, extra, answer in can:
        args = ["auth", "can-i", verb, what, "-A", *([extra] if extra else [])]
        assert kubectl(admin, *args, f"--as={OPERATOR_USER.name}").stdout.strip() == answer, (
            verb, what,
        )  # fmt: skip
    refused = kubectl(admin, "get", "configmaps", "-n", "default", f"--as={OPERATOR_USER.name}")
    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        "Error from server (Forbidden): configmaps is forbidden: User "
        '"system:serviceaccount:caliban-drain:caliban-drain-operator" cannot list resource '
        '"configmaps" in API group "" in the namespace "default"'
    )
    bad_token = urllib.request.Request(
        rbac_api.server.url + "/api/v1/pods", headers={"Authorization": "Bearer x"}
    )
    with pytest.raises(urllib.error.HTTPError) as unauthorized:
        urllib.request.urlopen(bad_token, timeout=10)  # the API on 127.0.0.1
    assert unauthorized.value.code == 401
    recorded = authz.read_record(tmp_path / "requests.jsonl")
    assert (
        authz.RecordedRequest(
            OPERATOR_USER.name, "list", "", "configmaps", "", "default", "", allowed=False
        )
        in recorded
    )
