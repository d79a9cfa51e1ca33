"""The status a pass reads and writes, typed (``orchestrator.operator.status``): every
field the operator writes is one the CRD declares, a hand-edited field of the wrong type
reads as unset instead of failing the pass, another writer's fields are kept, and a
pass's patch holds only what changed."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast, get_type_hints

import kopf
import yaml

from orchestrator.operator.status import StatusWrite, TaskStatus, aliased

CRD = (
    Path(__file__).resolve().parents[2] / "orchestrator" / "operator" / "crds" / "calibantask.yaml"
)


def crd_status_fields() -> set[str]:
    crd = yaml.safe_load(CRD.read_text())
    [version] = crd["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    return set(schema["properties"])


def test_every_field_a_pass_writes_is_declared_by_the_crd() -> None:
    written = set(aliased(cast(StatusWrite, dict.fromkeys(get_type_hints(StatusWrite)))))
    assert written <= crd_status_fields(), written - crd_status_fields()
    assert set(TaskStatus.model_fields) == set(get_type_hints(StatusWrite))


def test_status_reads_by_python_names_and_keeps_what_it_does_not_know() -> None:
    raw: dict[str, Any] = {
        "phase": "Running", "checkpointRef": "ckpt-1", "serviceFQDN": "t-sbx.ns.svc",
        "lastOperation": {"id": "op", "kind": "pause", "state": "recorded"},
        "calibandEndpoint": "t-sbx.ns:7443",  # caliban-operator's
    }  # fmt: skip
    status = TaskStatus.read(raw)
    assert (status.phase, status.checkpoint_ref, status.service_fqdn) == (
        "Running", "ckpt-1", "t-sbx.ns.svc",
    )  # fmt: skip
    assert status.last_operation == {"id": "op", "kind": "pause", "state": "recorded"}
    assert status.model_extra == {"calibandEndpoint": "t-sbx.ns:7443"}


def test_a_field_of_the_wrong_type_reads_as_unset_and_the_rest_still_reads() -> None:
    status = TaskStatus.read({"phase": "Suspended", "agents": "three", "pauses": 2,
                              "scaling": "yes"})  # fmt: skip
    assert (status.phase, status.agents, status.pauses, status.scaling) == (
        "Suspended", None, 2, None,
    )  # fmt: skip


def test_a_pass_patches_only_what_it_changed() -> None:
    from orchestrator.operator.taskpass import TaskPass

    body = {"metadata": {"name": "t", "namespace": "ns", "uid": "u"},
            "status": {"phase": "Running", "agents": 2, "calibandEndpoint": "x"}}  # fmt: skip
    patch = kopf.Patch()
    # A status write reads and changes nothing but the object and its patch.
    context = cast(Any, SimpleNamespace(ledger=None, settings=None))
    p = TaskPass(kopf.Body(cast(kopf.RawBody, body)), patch, context)
    p.set_status(agents=2, phase="Running")
    assert dict(patch.get("status") or {}) == {}
    p.set_status(agents=3, idle_since=None, checkpoint_ref="ckpt-2")
    # idleSince was not there: removing it writes nothing.
    assert dict(patch["status"]) == {"agents": 3, "checkpointRef": "ckpt-2"}
    assert (p.status.agents, p.status.checkpoint_ref) == (3, "ckpt-2")
    p.set_status(phase="Suspended", agents=0, checkpoint_ref=None)
    assert dict(patch["status"]) == {"agents": 0, "checkpointRef": None, "phase": "Suspended"}
    assert (p.status.phase, p.status.checkpoint_ref) == ("Suspended", None)
