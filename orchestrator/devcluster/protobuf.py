"""The few protobuf bodies the embedded Kubernetes API reads.

kubectl's generators (``kubectl create namespace``, ``create configmap``, ``create
secret``) send built-in objects as ``application/vnd.kubernetes.protobuf`` and do not
retry as JSON when a server refuses it. This decodes the Kubernetes envelope (the
``k8s\\0`` magic and ``runtime.Unknown``) and the messages of Namespace, ConfigMap and
Secret (with the ObjectMeta fields a client sets) into the JSON form the store takes, and
the SelfSubjectAccessReview of ``kubectl auth can-i``;
anything else is refused with a message saying to use ``kubectl apply -f``. Field numbers
are those of Kubernetes' ``generated.proto``. Pure; ``emulator`` calls :func:`decode`.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from typing import Any

MAGIC = b"k8s\x00"
CONTENT_TYPE = "application/vnd.kubernetes.protobuf"


class ProtobufError(ValueError):
    """A body this module cannot read; the message says what to do instead."""


Field = tuple[int, int, int | bytes]  # (number, wire type, value)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ProtobufError("truncated protobuf varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(data: bytes) -> Iterator[Field]:
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield number, wire, value
        elif wire == 2:
            length, pos = _varint(data, pos)
            yield number, wire, data[pos : pos + length]
            pos += length
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ProtobufError(f"unsupported protobuf wire type {wire}")


def _text(value: int | bytes) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _map_entry(value: int | bytes) -> tuple[str, bytes]:
    key, item = "", b""
    for number, _, part in _fields(value if isinstance(value, bytes) else b""):
        if number == 1:
            key = _text(part)
        elif number == 2 and isinstance(part, bytes):
            item = part
    return key, item


def _owner_reference(data: bytes) -> dict[str, Any]:
    names = {1: "kind", 3: "name", 4: "uid", 5: "apiVersion"}
    flags = {6: "controller", 7: "blockOwnerDeletion"}
    ref: dict[str, Any] = {}
    for number, _, value in _fields(data):
        if number in names:
            ref[names[number]] = _text(value)
        elif number in flags:
            ref[flags[number]] = bool(value)
    return ref


def _object_meta(data: bytes) -> dict[str, Any]:
    scalars = {1: "name", 2: "generateName", 3: "namespace", 5: "uid", 6: "resourceVersion"}
    meta: dict[str, Any] = {}
    for number, _, value in _fields(data):
        if number in scalars and _text(value):  # proto3 sends empty strings too
            meta[scalars[number]] = _text(value)
        elif number in (11, 12):
            key, item = _map_entry(value)
            meta.setdefault("labels" if number == 11 else "annotations", {})[key] = item.decode()
        elif number == 13 and isinstance(value, bytes):
            meta.setdefault("ownerReferences", []).append(_owner_reference(value))
        elif number == 14:
            meta.setdefault("finalizers", []).append(_text(value))
    return meta


def _namespace(data: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Namespace"}
    for number, _, value in _fields(data):
        if number == 1 and isinstance(value, bytes):
            obj["metadata"] = _object_meta(value)
        elif number == 2 and isinstance(value, bytes):
            finalizers = [_text(v) for n, _, v in _fields(value) if n == 1]
            obj["spec"] = {"finalizers": finalizers} if finalizers else {}
    return obj


def _config_map(data: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap"}
    for number, _, value in _fields(data):
        if number == 1 and isinstance(value, bytes):
            obj["metadata"] = _object_meta(value)
        elif number in (2, 3):
            key, item = _map_entry(value)
            if number == 2:
                obj.setdefault("data", {})[key] = item.decode()
            else:
                obj.setdefault("binaryData", {})[key] = base64.b64encode(item).decode()
        elif number == 4:
            obj["immutable"] = bool(value)
    return obj


def _secret(data: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque"}
    for number, _, value in _fields(data):
        if number == 1 and isinstance(value, bytes):
            obj["metadata"] = _object_meta(value)
        elif number in (2, 4):
            key, item = _map_entry(value)
            if number == 2:
                obj.setdefault("data", {})[key] = base64.b64encode(item).decode()
            else:
                obj.setdefault("stringData", {})[key] = item.decode()
        elif number == 3 and _text(value):
            obj["type"] = _text(value)
        elif number == 5:
            obj["immutable"] = bool(value)
    return obj


def _self_subject_access_review(data: bytes) -> dict[str, Any]:
    """What ``kubectl auth can-i`` asks (``authz`` answers it)."""
    resource = {
        1: "namespace",
        2: "verb",
        3: "group",
        4: "version",
        5: "resource",
        6: "subresource",
        7: "name",
    }
    spec: dict[str, Any] = {}
    for number, _, value in _fields(data):
        if number != 2 or not isinstance(value, bytes):
            continue
        for part, _, attributes in _fields(value):
            if part == 1 and isinstance(attributes, bytes):
                spec["resourceAttributes"] = {
                    resource[n]: _text(v)
                    for n, _, v in _fields(attributes)
                    if n in resource and _text(v)
                }
            elif part == 2 and isinstance(attributes, bytes):
                names = {1: "path", 2: "verb"}
                spec["nonResourceAttributes"] = {
                    names[n]: _text(v) for n, _, v in _fields(attributes) if n in names
                }
    return {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": spec,
    }


_DECODERS: dict[tuple[str, str], Callable[[bytes], dict[str, Any]]] = {
    ("v1", "Namespace"): _namespace,
    ("v1", "ConfigMap"): _config_map,
    ("v1", "Secret"): _secret,
    ("authorization.k8s.io/v1", "SelfSubjectAccessReview"): _self_subject_access_review,
}


def decode(body: bytes) -> dict[str, Any]:
    """A Kubernetes protobuf body as a JSON-shaped object."""
    if not body.startswith(MAGIC):
        raise ProtobufError("not a Kubernetes protobuf body (no k8s magic prefix)")
    api_version = kind = ""
    raw = b""
    for number, _, value in _fields(body[len(MAGIC) :]):
        if number == 1 and isinstance(value, bytes):
            for type_number, _, type_value in _fields(value):
                if type_number == 1:
                    api_version = _text(type_value)
                elif type_number == 2:
                    kind = _text(type_value)
        elif number == 2 and isinstance(value, bytes):
            raw = value
    decoder = _DECODERS.get((api_version, kind))
    if decoder is None:
        raise ProtobufError(
            f"the embedded API reads protobuf only for Namespace, ConfigMap, Secret and "
            f"SelfSubjectAccessReview, not "
            f"{api_version}/{kind}; send JSON or YAML instead (kubectl apply -f FILE)"
        )
    return decoder(raw)
