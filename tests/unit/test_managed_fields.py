"""Field ownership as structured-merge-diff defines it (``managed_fields``): the field set of
an apply configuration, the FieldsV1 form, merging by list type, removal of fields an
applier stops setting, and conflicts against shared ownership and ``force``."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.devcluster import managed_fields as mf

BUILTIN = mf.root_shape(None)
IGNORE_NOTHING = mf.ignored_paths(subresource=None, status_subresource=False)
NOW = "2025-01-01T00:00:00Z"

CR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "properties": {
                "replicas": {"type": "integer"},
                "ports": {
                    "type": "array",
                    "x-kubernetes-list-type": "map",
                    "x-kubernetes-list-map-keys": ["port", "protocol"],
                    "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                },
                "tags": {
                    "type": "array",
                    "x-kubernetes-list-type": "set",
                    "items": {"type": "string"},
                },
                "args": {"type": "array", "items": {"type": "string"}},
                "selector": {
                    "type": "object",
                    "x-kubernetes-map-type": "atomic",
                    "additionalProperties": {"type": "string"},
                },
                "extra": {
                    "type": "object",
                    "additionalProperties": {"type": "object", "properties": {"a": {}}},
                },
            },
        },
    },
}
CR = mf.root_shape(CR_SCHEMA)


def pod(**containers: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "labels": {"app": "x"}},
        "spec": {"containers": [{"name": n, "image": i} for n, i in containers.items()]},
    }


def apply(
    entries: list[mf.Entry],
    live: dict[str, Any],
    config: dict[str, Any],
    manager: str,
    *,
    force: bool = False,
    shape: mf.Shape = BUILTIN,
) -> tuple[Any, list[mf.Entry]]:
    return mf.applied(
        entries,
        live,
        config,
        shape,
        manager=manager,
        api_version="v1",
        subresource=None,
        time=NOW,
        force=force,
        ignored=mf.ignored_paths(subresource=None, status_subresource=False),
    )


def update(
    entries: list[mf.Entry], old: dict[str, Any], new: dict[str, Any], manager: str
) -> list[mf.Entry]:
    return mf.updated(
        entries,
        old,
        new,
        BUILTIN,
        manager=manager,
        api_version="v1",
        subresource=None,
        time=NOW,
        ignored=mf.ignored_paths(subresource=None, status_subresource=False),
    )


def owners(entries: list[mf.Entry]) -> dict[str, set[str]]:
    return {e.manager: {mf.path_text(p) for p in e.fields} for e in entries}


# ------------------------------------------------------------------ field sets


def test_the_field_set_of_a_pod_names_leaves_and_keyed_items_as_a_real_server_does() -> None:
    fields = mf.field_set(pod(c="busybox"), BUILTIN)
    ignore = mf.ignored_paths(subresource=None, status_subresource=False)
    owned = frozenset(p for p in fields if not ignore(p))
    assert mf.to_fields_v1(owned) == {
        "f:metadata": {"f:labels": {"f:app": {}}},
        "f:spec": {"f:containers": {'k:{"name":"c"}': {".": {}, "f:image": {}, "f:name": {}}}},
    }
    assert mf.from_fields_v1(mf.to_fields_v1(owned)) == owned


def test_sets_are_owned_item_by_item_and_atomic_lists_and_maps_whole() -> None:
    config = {
        "metadata": {"finalizers": ["a/b"]},
        "spec": {"tags": ["x", "y"], "args": ["-v"], "selector": {"app": "x"}},
    }
    paths = {mf.path_text(p) for p in mf.field_set(config, CR)}
    assert paths == {
        '.metadata.finalizers[="a/b"]',
        '.spec.tags[="x"]',
        '.spec.tags[="y"]',
        ".spec.args",
        ".spec.selector",
    }


def test_map_elements_with_members_are_marked_as_members_themselves() -> None:
    fields = mf.field_set({"spec": {"extra": {"one": {"a": 1}}}}, CR)
    assert mf.to_fields_v1(fields) == {"f:spec": {"f:extra": {"f:one": {".": {}, "f:a": {}}}}}


def test_multi_key_items_are_keyed_by_every_key_and_printed_as_a_real_server_prints_them() -> None:
    config = {"spec": {"ports": [{"port": 80, "protocol": "TCP", "name": "http"}]}}
    paths = {mf.path_text(p) for p in mf.field_set(config, CR)}
    assert '.spec.ports[port=80,protocol="TCP"].name' in paths
    assert ("f:spec", "f:ports", 'k:{"port":80,"protocol":"TCP"}') in mf.field_set(config, CR)


# ------------------------------------------------------------------ updates


def test_a_create_is_recorded_as_an_update_of_every_field_it_set() -> None:
    entries = update([], {}, pod(c="busybox"), "kubectl-create")
    (entry,) = entries
    assert entry.operation == mf.UPDATE
    assert entry.encode()["fieldsV1"] == {
        "f:metadata": {"f:labels": {".": {}, "f:app": {}}},
        "f:spec": {
            ".": {},
            "f:containers": {
                ".": {},
                'k:{"name":"c"}': {".": {}, "f:image": {}, "f:name": {}},
            },
        },
    }


def test_an_update_takes_the_fields_it_changes_and_removed_fields_leave_every_owner() -> None:
    old = pod(c="busybox")
    entries = update([], {}, old, "creator")
    new = pod(c="nginx")
    del new["metadata"]["labels"]
    entries = update(entries, old, new, "editor")
    got = owners(entries)
    assert '.spec.containers[name="c"].image' in got["editor"]
    assert '.spec.containers[name="c"].image' not in got["creator"]
    assert not any("labels" in p for ps in got.values() for p in ps)


def test_an_update_that_changes_nothing_records_nothing() -> None:
    assert update([], pod(c="a"), pod(c="a"), "noop") == []


# ------------------------------------------------------------------ apply


def test_an_apply_owns_exactly_its_configuration_and_merges_keyed_lists() -> None:
    live = pod(a="one", b="two")
    entries = update([], {}, live, "creator")
    merged, entries = apply(entries, live, pod(b="two", c="three"), "ssa")
    assert [c["name"] for c in merged["spec"]["containers"]] == ["a", "b", "c"]
    assert owners(entries)["ssa"] >= {
        '.spec.containers[name="b"]',
        '.spec.containers[name="c"].image',
    }


def test_fields_an_applier_stops_setting_are_removed_unless_another_manager_owns_them() -> None:
    config = pod(c="busybox")
    config["metadata"]["labels"]["tier"] = "web"
    config["metadata"]["annotations"] = {"note": "x"}
    live, entries = apply([], {}, config, "ssa")
    live["metadata"]["labels"]["kept"] = "by-editor"
    entries = update(entries, pod(c="busybox") | {"metadata": config["metadata"]}, live, "editor")
    smaller = pod(c="busybox")
    merged, entries = apply(entries, live, smaller, "ssa")
    assert merged["metadata"]["labels"] == {"app": "x", "kept": "by-editor"}
    assert "annotations" not in merged["metadata"]
    assert ".metadata.labels.tier" not in owners(entries)["ssa"]


def test_a_dropped_container_goes_but_one_another_manager_shares_stays() -> None:
    live, entries = apply([], {}, pod(a="one", b="two"), "ssa")
    live, entries = apply(entries, live, pod(b="two"), "other")  # same value: shared
    merged, entries = apply(entries, live, pod(), "ssa")
    assert [c["name"] for c in merged["spec"]["containers"]] == ["b"]


def test_a_different_value_owned_by_another_manager_is_a_conflict() -> None:
    live, entries = apply([], {}, {"spec": {"replicas": 1}}, "kubectl")
    with pytest.raises(mf.ApplyConflict) as caught:
        apply(entries, live, {"spec": {"replicas": 3}}, "caliban-drain")
    assert caught.value.message == (
        'Apply failed with 1 conflict: conflict with "kubectl": .spec.replicas'
    )
    assert caught.value.causes() == [
        {
            "reason": "FieldManagerConflict",
            "message": 'conflict with "kubectl"',
            "field": ".spec.replicas",
        }
    ]


def test_an_updater_is_named_with_its_version_and_several_conflicts_are_listed() -> None:
    old: dict[str, Any] = {"spec": {}}
    live = {"spec": {"replicas": 1, "paused": False}}
    entries = update([], old, live, "kubectl-client-side-apply")
    with pytest.raises(mf.ApplyConflict) as caught:
        apply(entries, live, {"spec": {"replicas": 2, "paused": True}}, "x")
    assert caught.value.message == (
        "Apply failed with 2 conflicts: "
        'conflicts with "kubectl-client-side-apply" using v1:\n'
        "- .spec.paused\n"
        "- .spec.replicas"
    )


def test_the_same_value_is_shared_and_force_takes_a_different_one() -> None:
    live, entries = apply([], {}, {"spec": {"replicas": 1}}, "kubectl")
    live, entries = apply(entries, live, {"spec": {"replicas": 1}}, "caliban-drain")
    assert owners(entries) == {"kubectl": {".spec.replicas"}, "caliban-drain": {".spec.replicas"}}
    live, entries = apply(entries, live, {"spec": {"replicas": 4}}, "caliban-drain", force=True)
    assert live["spec"]["replicas"] == 4
    assert owners(entries) == {"caliban-drain": {".spec.replicas"}}


def test_atomic_lists_are_replaced_whole_and_sets_merge() -> None:
    live, entries = apply([], {}, {"spec": {"args": ["a", "b"], "tags": ["x"]}}, "one", shape=CR)
    with pytest.raises(mf.ApplyConflict, match=r'"one": \.spec\.args'):
        apply(entries, live, {"spec": {"args": ["c"], "tags": ["y"]}}, "two", shape=CR)
    merged, entries = apply(
        entries, live, {"spec": {"args": ["c"], "tags": ["y"]}}, "two", force=True, shape=CR
    )
    assert merged["spec"] == {"args": ["c"], "tags": ["x", "y"]}
    assert owners(entries) == {
        "one": {'.spec.tags[="x"]'},
        "two": {".spec.args", '.spec.tags[="y"]'},
    }


def test_an_object_without_managed_fields_is_first_owned_by_before_first_apply() -> None:
    live = {"spec": {"replicas": 1}}
    with pytest.raises(mf.ApplyConflict, match='"before-first-apply" using v1'):
        apply([], live, {"spec": {"replicas": 2}}, "kubectl")


def test_managed_fields_a_client_sends_replace_or_clear_only_as_a_real_server_allows() -> None:
    live = [mf.Entry("a", mf.UPDATE, "v1", NOW, frozenset({("f:spec",)})).encode()]
    mine = [mf.Entry("b", mf.APPLY, "v1", NOW, frozenset({("f:data",)})).encode()]
    assert mf.requested_entries(live, [], subresource=None) == []
    assert mf.requested_entries(live, [{}], subresource=None) == []
    assert [e.manager for e in mf.requested_entries(live, mine, subresource=None)] == ["b"]
    assert [e.manager for e in mf.requested_entries(live, mine, subresource="status")] == ["a"]
    assert [e.manager for e in mf.requested_entries(live, [{"x": 1}], subresource=None)] == ["a"]


def test_entries_are_ordered_appliers_first() -> None:
    update_entry = mf.Entry("a", mf.UPDATE, "v1", "2024-01-01T00:00:00Z", frozenset({("f:x",)}))
    apply_entry = mf.Entry("z", mf.APPLY, "v1", "2025-01-01T00:00:00Z", frozenset({("f:y",)}))
    assert [e["manager"] for e in mf.encode([update_entry, apply_entry])] == ["z", "a"]


def test_status_writes_own_only_status() -> None:
    ignored = mf.ignored_paths(subresource="status", status_subresource=True)
    assert ignored(("f:spec", "f:replicas"))
    assert not ignored(("f:status", "f:phase"))
    main = mf.ignored_paths(subresource=None, status_subresource=True)
    assert main(("f:status", "f:phase")) and not main(("f:spec",))
    assert IGNORE_NOTHING(("f:metadata", "f:name"))
