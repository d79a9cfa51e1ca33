"""The Pod object the stand-in Sandbox controller shows for each process it runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from orchestrator.devcluster.sandbox_controller import (
    POD_FINALIZER,
    POD_LABEL,
    SandboxController,
    pod_manifest,
)
from orchestrator.operator.crd import SANDBOX_V1ALPHA1, TASK_LABEL

SANDBOX = {
    "apiVersion": SANDBOX_V1ALPHA1,
    "kind": "Sandbox",
    "metadata": {"name": "twin-a", "namespace": "default", "uid": "3a379f98-1000-4d2e"},
    "spec": {"podTemplate": {"metadata": {"labels": {TASK_LABEL: "twin-a"}}}},
}
POD_SPEC = {
    "containers": [{"name": "caliband", "image": "caliban-drain:dev", "args": ["daemon"]}],
    "volumes": [{"name": "workspace", "persistentVolumeClaim": {"claimName": "ws-1"}}],
}


def test_a_pod_is_owned_by_its_sandbox_and_held_by_its_process() -> None:
    pod = pod_manifest(SANDBOX, POD_SPEC)
    meta = pod["metadata"]
    # Another uid (a Sandbox re-created under the name) is another pod.
    assert meta["name"] == "twin-a-3a379"
    assert meta["labels"] == {TASK_LABEL: "twin-a", POD_LABEL: "true"}
    assert meta["finalizers"] == [POD_FINALIZER]
    (owner,) = meta["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "Sandbox", "twin-a", "3a379f98-1000-4d2e", True
    )  # fmt: skip
    # Who mounts which PVC is read from the volumes, as on a cluster.
    assert pod["spec"]["volumes"] == POD_SPEC["volumes"]
    assert pod["spec"]["containers"] == [{"name": "caliband", "image": "caliban-drain:dev"}]


def test_a_long_sandbox_name_still_gives_a_valid_pod_name() -> None:
    long = {**SANDBOX, "metadata": {**SANDBOX["metadata"], "name": "t" * 253}}  # type: ignore[dict-item]
    assert len(pod_manifest(long, POD_SPEC)["metadata"]["name"]) <= 253


def test_the_stand_in_reports_a_sandboxs_readiness_and_service_as_the_controller_does() -> None:
    from orchestrator.devcluster.sandbox_controller import sandbox_status

    up = sandbox_status("t-sbx", "ns", ("True", "DependenciesReady", "running"), running=True,
                        version="v1alpha1")  # fmt: skip
    assert up["serviceFQDN"] == "t-sbx.ns.svc.cluster.local"
    assert up["replicas"] == 1
    [ready] = up["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == (
        "Ready",
        "True",
        "DependenciesReady",
    )
    down = sandbox_status("t-sbx", "ns", ("False", "SandboxSuspended", "none"), running=False,
                          version="v1alpha1")  # fmt: skip
    assert down["replicas"] == 0 and down["conditions"][0]["status"] == "False"


def test_at_v1beta1_the_stand_in_writes_no_status_replicas_which_that_version_lacks() -> None:
    from orchestrator.devcluster.sandbox_controller import sandbox_status

    up = sandbox_status("t-sbx", "ns", ("True", "DependenciesReady", "running"), running=True,
                        version="v1beta1")  # fmt: skip
    assert "replicas" not in up
    assert up["serviceFQDN"] == "t-sbx.ns.svc.cluster.local"
    assert up["conditions"][0]["status"] == "True"


@pytest.mark.parametrize(
    ("version", "spec", "deleting", "runs"),
    [
        pytest.param("v1beta1", {"operatingMode": "Running"}, False, True, id="beta-running"),
        pytest.param("v1beta1", {"operatingMode": "Suspended"}, False, False, id="beta-suspended"),
        pytest.param("v1beta1", {}, False, True, id="beta-unset-runs"),
        pytest.param("v1alpha1", {"replicas": 1}, False, True, id="alpha-one"),
        pytest.param("v1alpha1", {"replicas": 0}, False, False, id="alpha-zero"),
        pytest.param("v1alpha1", {}, False, True, id="alpha-unset-runs"),
        pytest.param("v1beta1", {"operatingMode": "Running"}, True, False, id="beta-deleting"),
        pytest.param("v1alpha1", {"replicas": 1}, True, False, id="alpha-deleting"),
    ],
)
def test_the_stand_in_honours_each_versions_suspension_field(
    version: str, spec: dict[str, object], deleting: bool, runs: bool
) -> None:
    from orchestrator.devcluster.sandbox_controller import should_run

    meta = {"name": "s", "deletionTimestamp": "2026-12-05T08:00:00Z"} if deleting else {"name": "s"}
    assert should_run(version, {"metadata": meta, "spec": spec}) is runs


class Passes(SandboxController):
    """The stand-in's loop as it runs, its passes' work recorded instead of done."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir, interval=3600)
        self.passes: asyncio.Queue[str] = asyncio.Queue()

    async def converge(self) -> None:
        self.woken.clear()
        self.passes.put_nowait("poll")

    async def converge_volumes(self) -> None:
        self.passes.put_nowait("volumes")


def test_a_wake_has_the_csi_driver_converge_at_once_rather_than_at_the_next_poll(
    tmp_path: Path,
) -> None:
    async def scenario() -> list[str]:
        controller = Passes(tmp_path)
        running = asyncio.get_running_loop().create_task(controller.run())
        seen = [await asyncio.wait_for(controller.passes.get(), 10)]
        controller.wake()
        seen.append(await asyncio.wait_for(controller.passes.get(), 10))
        controller.stopping.set()
        await asyncio.wait_for(running, 10)
        return seen

    assert asyncio.run(scenario()) == ["poll", "volumes"]
