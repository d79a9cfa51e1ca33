"""The embedded Kubernetes API as its users meet it: the real ``kubectl`` binary, a real
kopf operator, and raw HTTP where a client library would hide the behaviour (watch
resumption, conflicts, Status bodies). Each test gets its own server on a free port."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import kmock
import pytest
import yaml

from orchestrator.devcluster import DevClusterError, EmbeddedApiServer, write_kubeconfig
from orchestrator.devcluster.emulator import REQUESTS_PATH
from tests.support import LoopThread, wait_until

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs the kubectl binary")

T = TypeVar("T")
GROUP, VERSION = "caliban.caliban-ai.dev", "v1alpha1"
TASKS = f"/apis/{GROUP}/{VERSION}/namespaces/default/calibantasks"
PVCS = "/api/v1/namespaces/default/persistentvolumeclaims"

CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"calibantasks.{GROUP}"},
    "spec": {
        "group": GROUP,
        "names": {
            "kind": "CalibanTask",
            "plural": "calibantasks",
            "singular": "calibantask",
            "shortNames": ["ctask"],
        },
        "scope": "Namespaced",
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Checkpoint", "type": "string", "jsonPath": ".status.checkpointRef"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def task(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "CalibanTask",
        "metadata": {"name": name},
        "spec": spec or {"task": {"agents": 1}},
    }


class Cluster:
    """An :class:`EmbeddedApiServer` on its own event-loop thread, a kubeconfig for it, and
    the clients the tests drive it with."""

    def __init__(self, root: Path, state_file: Path | None = None) -> None:
        self.root = root
        self.kubeconfig = root / "kubeconfig"
        self._loop = LoopThread("embedded-api")
        self.server = self._loop.run(self._start(state_file))
        self.url = self.server.url
        write_kubeconfig(self.kubeconfig, self.url)

    @staticmethod
    async def _start(state_file: Path | None) -> EmbeddedApiServer:
        server = EmbeddedApiServer(state_file=state_file)
        await server.start()
        return server

    def close(self) -> None:
        self._loop.run(self.server.stop())
        self._loop.close()

    def kubectl(
        self, *args: str, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            self.kubectl_command(*args), input=stdin, capture_output=True, text=True, timeout=60
        )
        if check:
            assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result

    def kubectl_command(self, *args: str) -> list[str]:
        return [
            "kubectl",
            "--kubeconfig",
            str(self.kubeconfig),
            "--cache-dir",
            str(self.root / "cache"),
            *args,
        ]

    def patch(
        self,
        target: str,
        patch: str,
        *,
        patch_type: str = "merge",
        status: bool = False,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """``kubectl patch TARGET --type PATCH_TYPE -p PATCH [--subresource status]``."""
        subresource = ["--subresource", "status"] if status else []
        return self.kubectl(
            "patch", target, "--type", patch_type, "-p", patch, *subresource, check=check
        )

    def apply(
        self, manifest: dict[str, Any], *, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.kubectl("apply", "-f", "-", stdin=json.dumps(manifest), check=check)

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=30) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"null")

    def merge_patch(self, path: str, patch: dict[str, Any]) -> tuple[int, Any]:
        return self.request("PATCH", path, patch, "application/merge-patch+json")

    def get(self, path: str) -> dict[str, Any]:
        status, body = self.request("GET", path)
        assert status == 200, body
        assert isinstance(body, dict)
        return body

    def exists(self, path: str) -> bool:
        return self.request("GET", path)[0] == 200

    def watch(self, path: str, **params: str) -> list[dict[str, Any]]:
        """A watch read to its end (the server ends it at ``timeoutSeconds``)."""
        query = urllib.parse.urlencode({"watch": "true", **params})  # params may replace it
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as response:
            return [json.loads(line) for line in response.read().splitlines() if line.strip()]

    def requests_seen(self, action: kmock.action) -> list[kmock.Request]:
        return [r for r in list(self.server.emulator) if r.action == action]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    running = Cluster(tmp_path)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def tasks(cluster: Cluster) -> Cluster:
    """A cluster with the CalibanTask CRD applied by kubectl."""
    cluster.apply(CRD)
    return cluster


# ---------------------------------------------------------------------------- discovery


def test_the_request_count_names_each_client_and_method_and_not_its_own_reads(
    cluster: Cluster,
) -> None:
    """What a benchmark reads to tell the operator's calls from its own."""

    def get(path: str, agent: str) -> None:
        req = urllib.request.Request(cluster.url + path, headers={"User-Agent": agent})
        urllib.request.urlopen(req, timeout=30).close()

    before = cluster.get(REQUESTS_PATH)
    get("/api/v1/namespaces/default", "kopf/1.0")
    get("/api/v1/namespaces/default", "kopf/1.0")
    get("/api/v1/namespaces", "bench")
    cluster.merge_patch("/api/v1/namespaces/default", {"metadata": {"labels": {"a": "b"}}})
    after = cluster.get(REQUESTS_PATH)
    grown = {
        key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)
    }
    urllib_agent = f"Python-urllib/{sys.version_info.major}.{sys.version_info.minor}"
    assert grown == {"GET kopf/1.0": 2, "GET bench": 1, f"PATCH {urllib_agent}": 1}


def test_a_fresh_cluster_has_the_default_namespace_and_the_builtins(cluster: Cluster) -> None:
    namespaces = cluster.kubectl("get", "namespaces").stdout
    assert "default" in namespaces and "Active" in namespaces
    listed = cluster.kubectl("api-resources", "-o", "name").stdout.split()
    for name in (
        "namespaces",
        "events",
        "persistentvolumeclaims",
        "pods",
        "customresourcedefinitions.apiextensions.k8s.io",
        "events.events.k8s.io",
    ):
        assert name in listed


def test_an_applied_crd_is_served_with_its_names_verbs_and_status_subresource(
    tasks: Cluster,
) -> None:
    wide = tasks.kubectl("api-resources", f"--api-group={GROUP}", "-o", "wide").stdout
    assert "calibantasks" in wide and "ctask" in wide and "CalibanTask" in wide
    assert "create,delete,deletecollection,get,list,patch,update,watch" in wide
    # The legacy documents kopf reads list the status subresource it patches through.
    resources = tasks.get(f"/apis/{GROUP}/{VERSION}")["resources"]
    by_name = {r["name"]: r for r in resources}
    assert by_name["calibantasks"]["shortNames"] == ["ctask"]
    assert by_name["calibantasks"]["namespaced"] is True
    assert by_name["calibantasks/status"]["verbs"] == ["get", "patch", "update"]
    assert {g["name"] for g in tasks.get("/apis")["groups"]} >= {GROUP, "apiextensions.k8s.io"}


def test_kubectl_get_prints_the_crd_printer_columns_through_the_short_name(tasks: Cluster) -> None:
    tasks.apply(task("t1"))
    tasks.patch(
        "ctask/t1", '{"status": {"phase": "Running", "checkpointRef": "ck-7"}}', status=True
    )
    header, row = tasks.kubectl("get", "ctask").stdout.splitlines()
    assert header.split() == ["NAME", "PHASE", "CHECKPOINT", "AGE"]
    assert row.split()[:3] == ["t1", "Running", "ck-7"]
    assert row.split()[3].endswith("s")  # an age, not a timestamp


# ---------------------------------------------------------------------------- writes


def test_apply_creates_then_patches_a_changed_file_with_a_three_way_merge(tasks: Cluster) -> None:
    tasks.apply(task("t1", task={"agents": 1}, lifecycle={"idleTimeout": "5m"}))
    first = json.loads(tasks.kubectl("get", "ctask", "t1", "-o", "json").stdout)
    tasks.apply(task("t1", task={"agents": 3}))
    second = json.loads(tasks.kubectl("get", "ctask", "t1", "-o", "json").stdout)
    assert second["spec"] == {"task": {"agents": 3}}  # the dropped field is removed too
    assert second["metadata"]["generation"] == first["metadata"]["generation"] + 1
    assert second["metadata"]["uid"] == first["metadata"]["uid"]
    assert int(second["metadata"]["resourceVersion"]) > int(first["metadata"]["resourceVersion"])
    applied = json.loads(
        second["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"]
    )
    assert applied["spec"] == {"task": {"agents": 3}}


def test_apply_of_a_builtin_sends_a_strategic_merge_patch_that_applies(tasks: Cluster) -> None:
    pvc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "ws", "labels": {"old": "1"}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    tasks.apply(pvc)
    pvc["metadata"]["labels"] = {"new": "2"}
    tasks.apply(pvc)
    patches = [r for r in tasks.requests_seen(kmock.action.UPDATE) if r.url.path.endswith("/ws")]
    assert patches[-1].headers["Content-Type"] == "application/strategic-merge-patch+json"
    stored = tasks.get(f"{PVCS}/ws")
    assert stored["metadata"]["labels"] == {"new": "2"}
    assert stored["status"] == {"phase": "Pending"}
    assert "Pending" in tasks.kubectl("get", "pvc", "ws").stdout


def test_status_writes_change_only_status_and_never_the_generation(tasks: Cluster) -> None:
    tasks.apply(task("t1"))
    tasks.patch("ctask/t1", '{"spec": {"task": {"agents": 2}}, "status": {"phase": "Ignored"}}')
    after_spec = tasks.get(f"{TASKS}/t1")
    assert after_spec["spec"]["task"]["agents"] == 2 and "status" not in after_spec
    assert after_spec["metadata"]["generation"] == 2
    tasks.patch(
        "ctask/t1", '{"status": {"phase": "Running"}, "spec": {"task": {"agents": 9}}}', status=True
    )
    tasks.kubectl("annotate", "ctask", "t1", "note=hello")
    tasks.kubectl("label", "ctask", "t1", "team=blue")
    final = tasks.get(f"{TASKS}/t1")
    assert final["status"] == {"phase": "Running"}
    assert final["spec"]["task"]["agents"] == 2
    assert final["metadata"]["generation"] == 2
    assert final["metadata"]["annotations"]["note"] == "hello"
    assert final["metadata"]["labels"] == {"team": "blue"}


def test_json_patch_applies_and_a_failed_test_op_changes_nothing(tasks: Cluster) -> None:
    tasks.apply(task("t1"))
    tasks.patch(
        "ctask/t1",
        '[{"op": "replace", "path": "/spec/task/agents", "value": 4}]',
        patch_type="json",
    )
    assert tasks.get(f"{TASKS}/t1")["spec"]["task"]["agents"] == 4
    guarded = (
        '[{"op": "test", "path": "/spec/task/agents", "value": 1},'
        ' {"op": "replace", "path": "/spec/task/agents", "value": 5}]'
    )
    failed = tasks.patch("ctask/t1", guarded, patch_type="json", check=False)
    assert failed.returncode != 0
    assert tasks.get(f"{TASKS}/t1")["spec"]["task"]["agents"] == 4


def test_a_stale_resource_version_conflicts_and_failures_are_status_bodies(tasks: Cluster) -> None:
    status, created = tasks.request("POST", TASKS, task("t1"))
    assert status == 201
    stale = created["metadata"]["resourceVersion"]
    tasks.kubectl("label", "ctask", "t1", "moved=on")
    status, body = tasks.merge_patch(
        f"{TASKS}/t1", {"metadata": {"resourceVersion": stale}, "spec": {"x": 1}}
    )
    assert (status, body["kind"], body["reason"], body["code"]) == (409, "Status", "Conflict", 409)
    replaced = {**created, "spec": {"x": 2}}
    assert tasks.request("PUT", f"{TASKS}/t1", replaced)[0] == 409
    assert tasks.request("POST", TASKS, task("t1"))[1]["reason"] == "AlreadyExists"
    status, missing = tasks.request("GET", f"{TASKS}/nope")
    assert status == 404 and missing["reason"] == "NotFound"
    assert missing["message"] == f'calibantasks.{GROUP} "nope" not found'
    assert missing["details"] == {"name": "nope", "group": GROUP, "kind": "calibantasks"}
    error = tasks.kubectl("get", "ctask", "nope", check=False).stderr
    assert f'Error from server (NotFound): calibantasks.{GROUP} "nope" not found' in error


def test_objects_get_server_metadata_and_the_namespace_of_the_request(tasks: Cluster) -> None:
    status, created = tasks.request(
        "POST", TASKS, {**task("t1"), "metadata": {"name": "t1", "uid": "mine"}}
    )
    assert status == 201
    meta = created["metadata"]
    assert meta["namespace"] == "default" and meta["generation"] == 1
    assert meta["uid"] != "mine" and len(meta["uid"]) == 36
    assert meta["creationTimestamp"].endswith("Z") and meta["resourceVersion"].isdigit()
    status, event = tasks.request(
        "POST",
        "/api/v1/namespaces/default/events",
        {"metadata": {"generateName": "kopf-event-"}, "message": "m"},
    )
    assert status == 201 and event["metadata"]["name"].startswith("kopf-event-")
    status, body = tasks.request(
        "POST", "/api/v1/namespaces/nowhere/configmaps", {"metadata": {"name": "c"}}
    )
    assert (status, body["message"]) == (404, 'namespaces "nowhere" not found')


def test_labels_and_field_selectors_filter_lists(tasks: Cluster) -> None:
    for name, team in (("a", "blue"), ("b", "red"), ("c", None)):
        tasks.apply(task(name))
        if team:
            tasks.kubectl("label", "ctask", name, f"team={team}")

    def names(*selector: str) -> list[str]:
        return tasks.kubectl("get", "ctask", *selector, "-o", "name").stdout.split()

    assert names("-l", "team=blue") == ["calibantask.caliban.caliban-ai.dev/a"]
    assert len(names("-l", "team in (blue,red)")) == 2
    assert len(names("-l", "team")) == 2 and len(names("-l", "!team")) == 1
    assert len(names("-l", "team!=blue")) == 2
    assert names("--field-selector", "metadata.name=c") == ["calibantask.caliban.caliban-ai.dev/c"]


# ---------------------------------------------------------------------------- deletion


def test_kubectl_delete_waits_until_the_last_finalizer_is_released(tasks: Cluster) -> None:
    tasks.apply({**task("t1"), "metadata": {"name": "t1", "finalizers": ["example.dev/hold"]}})
    deleting = subprocess.Popen(
        tasks.kubectl_command("delete", "ctask", "t1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: tasks.get(f"{TASKS}/t1")["metadata"].get("deletionTimestamp"), 20, "mark"
        )
        held = tasks.get(f"{TASKS}/t1")["metadata"]
        assert held["deletionGracePeriodSeconds"] == 0 and held["finalizers"] == [
            "example.dev/hold"
        ]
        wait_until(
            lambda: any(
                "fieldSelector" in r.params for r in tasks.requests_seen(kmock.action.WATCH)
            ),
            20,
            "kubectl watching for the deletion",
        )
        assert deleting.poll() is None  # still waiting, as it should
        tasks.patch("ctask/t1", '{"metadata": {"finalizers": []}}')
        assert deleting.wait(timeout=20) == 0, deleting.communicate()[1]
    finally:
        if deleting.poll() is None:
            deleting.kill()
    assert not tasks.exists(f"{TASKS}/t1")


def test_a_json_patch_removing_the_last_finalizer_of_a_deleted_object_removes_it(
    tasks: Cluster,
) -> None:
    tasks.apply({**task("t1"), "metadata": {"name": "t1", "finalizers": ["a/b", "c/d"]}})
    status, marked = tasks.request("DELETE", f"{TASKS}/t1")
    assert status == 202 and marked["metadata"]["deletionTimestamp"]
    tasks.patch(
        "ctask/t1", '[{"op": "remove", "path": "/metadata/finalizers/0"}]', patch_type="json"
    )
    assert tasks.get(f"{TASKS}/t1")["metadata"]["finalizers"] == ["c/d"]
    added = tasks.patch("ctask/t1", '{"metadata": {"finalizers": ["c/d", "new/one"]}}', check=False)
    assert "no new finalizers can be added if the object is being deleted" in added.stderr
    tasks.patch(
        "ctask/t1", '[{"op": "remove", "path": "/metadata/finalizers/0"}]', patch_type="json"
    )
    assert not tasks.exists(f"{TASKS}/t1")
    assert tasks.request("POST", TASKS, task("t2"))[0] == 201
    assert tasks.request("DELETE", f"{TASKS}/t2")[0] == 200 and not tasks.exists(f"{TASKS}/t2")


def test_deleting_an_owner_collects_its_dependents_except_one_whose_reference_was_dropped(
    tasks: Cluster,
) -> None:
    owner = tasks.request("POST", TASKS, task("t1"))[1]
    reference = {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": "t1",
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }
    for name in ("collected", "retained"):
        pvc = {
            "metadata": {"name": name, "ownerReferences": [reference]},
            "spec": {"accessModes": ["ReadWriteOnce"]},
        }
        assert tasks.request("POST", PVCS, pvc)[0] == 201
    # What the operator does to keep a workspace: drop the owner reference first.
    tasks.patch(
        "pvc/retained",
        '[{"op": "add", "path": "/metadata/ownerReferences", "value": []}]',
        patch_type="json",
    )
    tasks.kubectl("delete", "ctask", "t1")
    assert not tasks.exists(f"{PVCS}/collected")
    assert tasks.exists(f"{PVCS}/retained")


def test_deleting_a_namespace_removes_what_is_in_it(tasks: Cluster) -> None:
    # kubectl's generators send these as protobuf.
    tasks.kubectl("create", "namespace", "team-a")
    tasks.kubectl("-n", "team-a", "create", "configmap", "settings", "--from-literal=a=b")
    tasks.kubectl("-n", "team-a", "apply", "-f", "-", stdin=json.dumps(task("t1")))
    assert tasks.get("/api/v1/namespaces/team-a/configmaps/settings")["data"] == {"a": "b"}
    tasks.kubectl("delete", "namespace", "team-a")
    assert not tasks.exists("/api/v1/namespaces/team-a")
    assert tasks.kubectl("get", "configmaps,ctask", "-A", "-o", "name").stdout.strip() == ""


def test_a_namespace_being_deleted_refuses_new_content_as_the_api_server_does(
    tasks: Cluster,
) -> None:
    tasks.kubectl("create", "namespace", "team-a")
    held = {**task("t1"), "metadata": {"name": "t1", "finalizers": ["example.com/hold"]}}
    tasks.kubectl("-n", "team-a", "apply", "-f", "-", stdin=json.dumps(held))
    tasks.kubectl("delete", "namespace", "team-a", "--wait=false")
    code, body = tasks.request(
        "POST", "/api/v1/namespaces/team-a/configmaps", {"metadata": {"name": "late"}}
    )
    assert (code, body["reason"]) == (403, "Forbidden"), body
    assert body["message"] == (
        'configmaps "late" is forbidden: unable to create new content in namespace team-a '
        "because it is being terminated"
    )
    assert body["details"]["causes"] == [{
        "reason": "NamespaceTerminating", "message": "namespace team-a is being terminated",
        "field": "metadata.namespace",
    }]  # fmt: skip
    # Changes to what is there are allowed: the held task lets go, and the namespace goes.
    tasks.merge_patch("/apis/caliban.caliban-ai.dev/v1alpha1/namespaces/team-a/calibantasks/t1",
                      {"metadata": {"finalizers": None}})  # fmt: skip
    wait_until(lambda: not tasks.exists("/api/v1/namespaces/team-a"), 30, "team-a to go")


# ---------------------------------------------------------------------------- watches & events


def test_a_watch_resumes_from_a_list_resource_version_and_ends_at_its_timeout(
    tasks: Cluster,
) -> None:
    tasks.request("POST", TASKS, task("before"))
    since = tasks.get(TASKS)["metadata"]["resourceVersion"]
    tasks.request("POST", TASKS, task("t1"))
    tasks.merge_patch(f"{TASKS}/t1", {"spec": {"x": 1}})
    tasks.request("DELETE", f"{TASKS}/t1")
    assert tasks.get(TASKS)["kind"] == "CalibanTaskList"
    started = time.monotonic()
    events = tasks.watch(
        TASKS, resourceVersion=since, timeoutSeconds="1", allowWatchBookmarks="true"
    )
    assert 0.9 < time.monotonic() - started < 5
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "t1"),
        ("MODIFIED", "t1"),
        ("DELETED", "t1"),
    ]
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == sorted(versions) and versions[0] > int(since)
    initial = tasks.watch(TASKS, timeoutSeconds="0.2")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in initial] == [("ADDED", "before")]


@pytest.mark.parametrize("flag", ["True", "1", "t", "TRUE"])
def test_watch_is_read_as_the_api_reads_a_boolean(tasks: Cluster, flag: str) -> None:
    """The Python client sends ``watch=True``: a watch, not a list (as the API reads any
    of Go's true values); an unknown value is no watch."""
    tasks.request("POST", TASKS, task("seen"))
    events = tasks.watch(TASKS, watch=flag, timeoutSeconds="0.2")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "seen")]
    listed = tasks.watch(TASKS, watch="yes", timeoutSeconds="0.2")
    assert [e["kind"] for e in listed] == ["CalibanTaskList"]


def test_a_watch_from_a_version_older_than_the_log_is_told_to_list_again(tasks: Cluster) -> None:
    tasks.server.emulator.state.log_size = 4
    since = tasks.get(TASKS)["metadata"]["resourceVersion"]
    for index in range(6):
        tasks.request("POST", TASKS, task(f"t{index}"))
    events = tasks.watch(TASKS, resourceVersion=since, timeoutSeconds="1")
    assert [(e["type"], e["object"]["code"], e["object"]["reason"]) for e in events] == [
        ("ERROR", 410, "Expired")
    ]


def test_a_selector_watch_reports_an_object_leaving_the_selection_as_deleted(
    tasks: Cluster,
) -> None:
    tasks.request(
        "POST", TASKS, {**task("t1"), "metadata": {"name": "t1", "labels": {"pool": "a"}}}
    )
    since = tasks.get(TASKS)["metadata"]["resourceVersion"]
    tasks.merge_patch(f"{TASKS}/t1", {"metadata": {"labels": {"pool": "b"}}})
    events = tasks.watch(TASKS, resourceVersion=since, labelSelector="pool=a", timeoutSeconds="0.3")
    assert [e["type"] for e in events] == ["DELETED"]


def test_events_of_both_apis_show_in_kubectl_get_events(tasks: Cluster) -> None:
    core = {
        "metadata": {"generateName": "kopf-event-"},
        "type": "Normal",
        "reason": "Provisioned",
        "message": "task t1 is running",
        "involvedObject": {"kind": "CalibanTask", "name": "t1"},
    }
    assert tasks.request("POST", "/api/v1/namespaces/default/events", core)[0] == 201
    v1 = {
        "metadata": {"name": "drained"},
        "type": "Warning",
        "reason": "ForcedCheckpoint",
        "note": "daemon unreachable",
        "regarding": {"kind": "CalibanTask", "name": "t1"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": "caliban-drain",
        "reportingInstance": "operator-0",
        "action": "Drain",
    }
    assert tasks.request("POST", "/apis/events.k8s.io/v1/namespaces/default/events", v1)[0] == 201
    listed = tasks.kubectl("get", "events").stdout
    assert "task t1 is running" in listed and "daemon unreachable" in listed
    assert "calibantask/t1" in listed and "ForcedCheckpoint" in listed
    as_core = tasks.get("/api/v1/namespaces/default/events/drained")
    assert as_core["message"] == "daemon unreachable" and as_core["involvedObject"]["name"] == "t1"


def test_a_reaction_a_test_adds_is_served_before_the_emulator(tasks: Cluster) -> None:
    """kmock's DSL still works on top: a test can inject a fault, here one failed PATCH."""
    tasks.apply(task("t1"))
    emulator = tasks.server.emulator
    emulator[kmock.method.PATCH, kmock.resource(plural="calibantasks")][:1] << 503
    failed = tasks.request(
        "PATCH", f"{TASKS}/t1", {"spec": {"x": 1}}, "application/merge-patch+json"
    )
    assert failed[0] == 503
    assert "x" not in tasks.get(f"{TASKS}/t1")["spec"]
    assert tasks.merge_patch(f"{TASKS}/t1", {"spec": {"x": 2}})[0] == 200
    assert tasks.get(f"{TASKS}/t1")["spec"]["x"] == 2


# ---------------------------------------------------------------------------- schemas


def test_a_crd_schema_fills_defaults_and_rejects_bad_fields_by_name(cluster: Cluster) -> None:
    crd = json.loads(json.dumps(CRD))
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"] = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "properties": {
                    "agents": {"type": "integer", "minimum": 1, "default": 1},
                    "onDelete": {
                        "type": "string",
                        "enum": ["checkpoint", "delete"],
                        "default": "checkpoint",
                    },
                    "idleTimeout": {"type": "string", "pattern": "^[0-9]+(s|m|h)$"},
                },
            },
            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    }
    cluster.apply(crd)
    cluster.apply(task("good", idleTimeout="5m"))
    assert cluster.get(f"{TASKS}/good")["spec"] == {
        "idleTimeout": "5m",
        "agents": 1,
        "onDelete": "checkpoint",
    }
    bad = cluster.apply(task("bad", agents=0, onDelete="maybe", idleTimeout="banana"), check=False)
    assert bad.returncode != 0
    assert 'The CalibanTask "bad" is invalid' in bad.stderr
    assert 'spec.onDelete: Unsupported value: "maybe"' in bad.stderr
    assert "spec.idleTimeout: Invalid value" in bad.stderr
    assert "spec.agents: Invalid value: 0" in bad.stderr
    unknown = cluster.apply(task("typo", agnets=2), check=False)
    assert 'unknown field "spec.agnets"' in unknown.stderr
    assert not cluster.exists(f"{TASKS}/bad") and not cluster.exists(f"{TASKS}/typo")


# ---------------------------------------------------------------------------- kopf

TINY_OPERATOR = """
import asyncio, logging, os, pathlib
import kopf

RESOURCE = ("caliban.caliban-ai.dev", "v1alpha1", "calibantasks")
MARKERS = pathlib.Path(os.environ["MARKER_DIR"])


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    settings.watching.server_timeout = 2  # reconnects on the way: resumes from a version
    settings.posting.level = logging.INFO


@kopf.on.create(*RESOURCE)
def created(name, body, patch, **_):
    patch.status["phase"] = "Running"
    kopf.info(body, reason="Provisioned", message=f"task {name} is running")


@kopf.on.update(*RESOURCE, field="spec.task.agents")
def rescaled(new, patch, **_):
    patch.status["agents"] = new


@kopf.on.delete(*RESOURCE)
async def deleted(name, **_):
    await asyncio.sleep(0.5)
    (MARKERS / f"deleted-{name}").write_text("drained")


@kopf.timer(*RESOURCE, interval=0.3)
def tick(status, patch, **_):
    patch.status["ticks"] = (status.get("ticks") or 0) + 1
"""


def test_a_kopf_operator_runs_its_handlers_and_finalizer_against_the_api(tasks: Cluster) -> None:
    (tasks.root / "tiny_operator.py").write_text(TINY_OPERATOR)
    env = {**os.environ, "KUBECONFIG": str(tasks.kubeconfig), "MARKER_DIR": str(tasks.root)}
    log = (tasks.root / "kopf.log").open("w")
    operator = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kopf",
            "run",
            "--standalone",
            "--all-namespaces",
            "tiny_operator.py",
        ],
        cwd=tasks.root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        tasks.apply(task("t1", task={"agents": 1}))
        tasks.kubectl("wait", "--for=jsonpath={.status.phase}=Running", "ctask/t1", "--timeout=30s")
        assert tasks.get(f"{TASKS}/t1")["metadata"]["finalizers"] == [
            "kopf.zalando.org/KopfFinalizerMarker"
        ]
        wait_until(
            lambda: "task t1 is running" in tasks.kubectl("get", "events").stdout, 20, "event"
        )
        wait_until(
            lambda: tasks.get(f"{TASKS}/t1")["status"].get("ticks", 0) >= 3, 20, "timer ticks"
        )
        tasks.patch("ctask/t1", '{"spec": {"task": {"agents": 3}}}')
        wait_until(
            lambda: tasks.get(f"{TASKS}/t1")["status"].get("agents") == 3, 20, "update handler"
        )
        tasks.kubectl("delete", "ctask", "t1", "--timeout=30s")
        # kubectl returned: the handler had finished and kopf had released its finalizer.
        assert (tasks.root / "deleted-t1").read_text() == "drained"
        assert not tasks.exists(f"{TASKS}/t1")
    finally:
        operator.send_signal(signal.SIGINT)
        try:
            operator.wait(timeout=15)
        except subprocess.TimeoutExpired:
            operator.kill()
        log.close()
    output = (tasks.root / "kopf.log").read_text()
    assert "Deletion is processed: 1 succeeded" in output
    assert "Traceback" not in output and "APIError" not in output


# ---------------------------------------------------------------------------- the command


def test_the_dev_cluster_command_serves_until_sigterm(tmp_path: Path) -> None:
    crd_file = tmp_path / "crd.yaml"
    crd_file.write_text(yaml.safe_dump(CRD))
    kubeconfig = tmp_path / "kubeconfig"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = (
        "import sys; from pathlib import Path; "
        "from orchestrator.devcluster import run_dev_cluster; "
        "run_dev_cluster(int(sys.argv[1]), Path(sys.argv[2]), [Path(sys.argv[3])])"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", script, str(port), str(kubeconfig), str(crd_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    watcher: subprocess.Popen[bytes] | None = None
    try:
        wait_until(kubeconfig.exists, 20, "the kubeconfig")
        config = yaml.safe_load(kubeconfig.read_text())
        assert config["clusters"][0]["cluster"]["server"] == f"http://127.0.0.1:{port}"
        kubectl = [
            "kubectl",
            "--kubeconfig",
            str(kubeconfig),
            "--cache-dir",
            str(tmp_path / "cache"),
        ]
        assert (
            "No resources found"
            in subprocess.run(
                [*kubectl, "get", "ctask"], capture_output=True, text=True, timeout=30, check=True
            ).stderr
        )
        watcher = subprocess.Popen(
            [*kubectl, "get", "namespaces", "--watch"], stdout=subprocess.PIPE
        )
        assert (
            watcher.stdout is not None
            and b"default" in watcher.stdout.readline() + watcher.stdout.readline()
        )
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=10) == 0
        assert time.monotonic() - started < 5  # an open watch does not hold the shutdown
    finally:
        for process in (server, watcher):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()


def test_a_port_in_use_is_reported_with_what_to_do() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            DevClusterError, match=f"cannot listen on 127.0.0.1:{port}.*pick another --port"
        ):
            asyncio.run(EmbeddedApiServer(port=port).start())


# ---------------------------------------------------------------------------- persistence


@pytest.fixture
def state_file(tmp_path: Path) -> Path:
    return tmp_path / "api-state.json"


def restarted(cluster: Cluster, state_file: Path) -> Cluster:
    """``cluster`` stopped (its last save on the way out) and a new one on its file."""
    cluster.close()
    return Cluster(cluster.root, state_file)


def test_a_restarted_api_keeps_every_object_as_it_was_and_its_counter_goes_on(
    tmp_path: Path, state_file: Path
) -> None:
    first = Cluster(tmp_path, state_file)
    first.apply(CRD)
    first.request("POST", TASKS, task("t1"))
    first.merge_patch(f"{TASKS}/t1", {"spec": {"task": {"agents": 3}}})
    first.patch("ctask/t1", '{"metadata": {"finalizers": ["example.com/hold"]}}')
    first.kubectl("delete", "ctask", "t1", "--wait=false")
    before = first.get(f"{TASKS}/t1")
    listed_at = int(first.get(TASKS)["metadata"]["resourceVersion"])
    second = restarted(first, state_file)
    try:
        after = second.get(f"{TASKS}/t1")
        assert after["metadata"] == before["metadata"]  # uid, rv, generation, timestamps
        assert after["metadata"]["generation"] == 3  # created, respecified, deleted
        assert after["spec"] == {"task": {"agents": 3}}
        assert int(second.get(TASKS)["metadata"]["resourceVersion"]) == listed_at
        created = second.request("POST", TASKS, task("t2"))[1]
        assert int(created["metadata"]["resourceVersion"]) == listed_at + 1
        # The restored deletion still completes once its finalizer goes.
        second.patch("ctask/t1", '{"metadata": {"finalizers": null}}')
        assert not second.exists(f"{TASKS}/t1")
    finally:
        second.close()


def test_a_watch_from_before_a_restore_is_told_to_list_again(
    tmp_path: Path, state_file: Path
) -> None:
    first = Cluster(tmp_path, state_file)
    first.apply(CRD)
    since = first.get(TASKS)["metadata"]["resourceVersion"]
    first.request("POST", TASKS, task("t1"))
    second = restarted(first, state_file)
    try:
        events = second.watch(TASKS, resourceVersion=since, timeoutSeconds="1")
        assert [(e["type"], e["object"]["code"], e["object"]["reason"]) for e in events] == [
            ("ERROR", 410, "Expired")
        ]
        listed = second.get(TASKS)
        assert [item["metadata"]["name"] for item in listed["items"]] == ["t1"]
        second.request("POST", TASKS, task("t2"))
        resumed = second.watch(
            TASKS, resourceVersion=listed["metadata"]["resourceVersion"], timeoutSeconds="0.3"
        )
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in resumed] == [("ADDED", "t2")]
    finally:
        second.close()


def test_restored_objects_are_collected_with_their_owner_and_their_namespace(
    tmp_path: Path, state_file: Path
) -> None:
    first = Cluster(tmp_path, state_file)
    first.apply(CRD)
    owner = first.request("POST", TASKS, task("t1"))[1]
    reference = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": "t1",
                 "uid": owner["metadata"]["uid"]}  # fmt: skip
    pvc = {"metadata": {"name": "workspace", "ownerReferences": [reference]}, "spec": {}}
    assert first.request("POST", PVCS, pvc)[0] == 201
    first.kubectl("create", "namespace", "team-a")
    held = {"metadata": {"name": "held", "finalizers": ["example.com/hold"]}}
    assert first.request("POST", "/api/v1/namespaces/team-a/configmaps", held)[0] == 201
    first.kubectl("delete", "namespace", "team-a", "--wait=false")
    second = restarted(first, state_file)
    try:
        assert second.get("/api/v1/namespaces/team-a")["status"]["phase"] == "Terminating"
        second.kubectl("delete", "ctask", "t1")
        assert not second.exists(f"{PVCS}/workspace")
        second.kubectl(
            "-n", "team-a", "patch", "configmap", "held", "--type", "merge",
            "-p", '{"metadata": {"finalizers": null}}',
        )  # fmt: skip
        wait_until(lambda: not second.exists("/api/v1/namespaces/team-a"), 10, "team-a to go")
    finally:
        second.close()


def test_an_upgraded_crd_replaces_the_restored_one(tmp_path: Path, state_file: Path) -> None:
    first = Cluster(tmp_path, state_file)
    first.apply(CRD)
    first.request("POST", TASKS, task("t1"))
    first.close()
    upgraded = json.loads(json.dumps(CRD))
    upgraded["spec"]["names"]["shortNames"] = ["ctask", "ct"]

    async def served() -> tuple[list[str], list[str]]:
        async with EmbeddedApiServer(crds=[upgraded], state_file=state_file) as server:
            crd = server.emulator.state.registry.lookup(GROUP, VERSION, "calibantasks")
            names = [k[2] for k, e in server.objects.items() if not e.deleted]
            return list(crd.short_names if crd else []), names

    short_names, names = asyncio.run(served())
    assert sorted(short_names) == ["ct", "ctask"]
    assert "t1" in names


@pytest.mark.parametrize(
    ("before", "after", "spec_after"),
    [
        pytest.param("v1alpha1", "v1beta1", ("v1beta1", "operatingMode", "Suspended"),
                     id="stand-in-state-then-agent-sandbox"),
        pytest.param("v1beta1", "v1alpha1", ("v1alpha1", "replicas", 0),
                     id="agent-sandbox-state-then-v1alpha1-only"),
    ],
)  # fmt: skip
def test_a_sandbox_stored_at_a_version_the_new_crd_no_longer_stores_is_kept(
    tmp_path: Path, state_file: Path, before: str, after: str, spec_after: tuple[str, str, Any]
) -> None:
    """A state dir from before the dev stack served agent-sandbox's CRD (its stand-in
    stored v1alpha1), or a stack restarted with another ``--sandbox-storage``: every
    Sandbox is still there, converted, as an API server reads any version it stored."""
    from orchestrator.devcluster.up import stack_crds

    def sandbox_crd(storage: str) -> dict[str, Any]:
        [found] = [c for c in stack_crds(storage, snapshots=False)
                   if c["metadata"]["name"] == "sandboxes.agents.x-k8s.io"]  # fmt: skip
        return found

    suspended = {"replicas": 0} if before == "v1alpha1" else {"operatingMode": "Suspended"}
    spec = {"podTemplate": {"spec": {"containers": [{"name": "c", "image": "i"}]}}, **suspended}
    sandbox = {"apiVersion": f"agents.x-k8s.io/{before}", "kind": "Sandbox",
               "metadata": {"name": "kept", "namespace": "default"}, "spec": spec}  # fmt: skip

    async def first() -> dict[str, Any]:
        async with EmbeddedApiServer(crds=[sandbox_crd(before)], state_file=state_file) as server:
            state = server.emulator.state
            served = state.registry.lookup("agents.x-k8s.io", before, "sandboxes")
            assert served is not None
            created, _ = state.create(served, "default", sandbox)
            return created

    async def second() -> list[dict[str, Any]]:
        async with EmbeddedApiServer(crds=[sandbox_crd(after)], state_file=state_file) as server:
            state = server.emulator.state
            read = []
            for version in ("v1alpha1", "v1beta1"):
                served = state.registry.lookup("agents.x-k8s.io", version, "sandboxes")
                if served is not None:
                    read.append(state.get(served, "default", "kept"))
            return read

    created = asyncio.run(first())
    read = asyncio.run(second())
    version, field, value = spec_after
    [at_new] = [r for r in read if r["apiVersion"] == f"agents.x-k8s.io/{version}"]
    assert at_new["spec"][field] == value
    assert at_new["metadata"]["uid"] == created["metadata"]["uid"]
    if after == "v1beta1":  # both served: v1alpha1 reads it converted
        [at_alpha] = [r for r in read if r["apiVersion"] == "agents.x-k8s.io/v1alpha1"]
        assert at_alpha["spec"]["replicas"] == 0


def test_a_corrupt_state_file_stops_dev_up_with_one_line_saying_how_to_start_fresh(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "api-state.json").write_text('{"format": 1, "objects": [')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DRAIN_", "KUBECONFIG"))}
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "dev", "up", "--state-dir", str(state),
         "--kubeconfig", str(tmp_path / "kubeconfig"), "--log-level", "WARNING"],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"Error: cannot restore the embedded Kubernetes API from {state}")
    assert "not valid JSON" in line
    assert "--fresh" in line
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "kubeconfig").exists()
