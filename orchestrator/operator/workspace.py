"""caliban-operator's Workspace API, resolved for one task: pure functions, table-tested
apart from the API calls that read the Workspace.

A task's ``spec.workspaceRef`` names a ``Workspace`` in its namespace; ``resolve`` turns
that Workspace and the task's ``spec.providerRef`` into a :class:`Binding`: the one
provider its agents use (``providerRef``, else the Workspace's ``defaultProvider``, else
its sole provider), the git sources cloned into the workspace volume, and the Workspace's
non-secret ``env``. The binding is pinned in ``status.resolvedWorkspace`` when the task
starts (what caliban-operator calls the workspace config pinned at admission), so the
task keeps the provider and sources it started with however the Workspace changes later.

Providers this operator can drive are OpenAI-compatible chat-completion endpoints:
``ollama`` (its ``/v1`` API; ``baseUrl`` defaults to the pod's own ``127.0.0.1:11434``),
and ``openai`` / ``openai-compatible`` (``baseUrl`` required: this project configures no
remote endpoint by default). Any other kind (``anthropic``…) is refused with
``UnsupportedProviderKind``, never run as something else. The credential stays in its
Secret: the binding holds only the Secret's name and key, and the pod reads the value
through ``secretKeyRef`` (``OPENAI_API_KEY``), so it is in no argument, log line, event,
status, ledger row or Celery message.
"""

from __future__ import annotations

import copy
import posixpath
import re
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from orchestrator.operator import crd
from orchestrator.operator.crd import Manifest
from worker_agent.k8s_names import is_dns_label

DRIVEN_KINDS: Final = ("ollama", "openai", "openai-compatible")
"""Provider kinds the daemon's ``openai`` provider drives."""
DAEMON_PROVIDER: Final = "openai"
"""The daemon's provider for every driven kind (``worker_agent.providers``)."""
OLLAMA_DEFAULT_URL: Final = "http://127.0.0.1:11434"
BASE_URL_ENV: Final = "OPENAI_BASE_URL"
API_KEY_ENV: Final = "OPENAI_API_KEY"
SOURCES_ENV: Final = "CALIBAN_SOURCES"
"""Read by ``drainctl sources`` (``worker_agent.sources.SOURCES_ENV``)."""
RESERVED_PATHS: Final = (crd.WORKSPACE_MOUNT, crd.RUN_MOUNT)


class WorkspaceProblem(Exception):
    """Why a task's Workspace cannot be used: ``reason`` is the condition's and event's."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Source:
    name: str
    repo: str
    ref: str
    path: str
    """Where the daemon container sees the checkout (a subPath mount of the workspace
    volume's ``sources/<name>``)."""


@dataclass(frozen=True)
class Binding:
    """What a task takes from its Workspace."""

    workspace: str
    provider: str
    """The Workspace's name for the provider (``planner``, ``workers``)."""
    kind: str
    model: str
    base_url: str
    """The OpenAI-compatible API root the agents call (``…/v1``)."""
    credentials: tuple[str, str] | None
    """(Secret name, key) of the API key, or None for a keyless provider."""
    sources: tuple[Source, ...]
    env: tuple[tuple[str, str], ...]
    runtime_class: str | None = None
    """The Workspace's default ``isolation.runtimeClass``: the pod's ``runtimeClassName``
    unless the task names its own."""

    def to_status(self) -> Manifest:
        """As ``status.resolvedWorkspace``: names only, never a credential's value."""
        provider: Manifest = {
            "name": self.provider, "kind": self.kind, "model": self.model,
            "baseUrl": self.base_url,
        }  # fmt: skip
        if self.credentials is not None:
            provider["credentialsRef"] = {
                "secretName": self.credentials[0], "key": self.credentials[1],
            }  # fmt: skip
        pinned: Manifest = {
            "name": self.workspace,
            "provider": provider,
            "sources": [
                {"name": s.name, "repo": s.repo, "ref": s.ref, "path": s.path} for s in self.sources
            ],
            "env": [{"name": n, "value": v} for n, v in self.env],
        }
        if self.runtime_class is not None:
            pinned["isolation"] = {"runtimeClass": self.runtime_class}
        return pinned

    @classmethod
    def from_status(cls, pinned: Any) -> Binding | None:
        """A binding pinned by ``to_status``; None for anything else (caliban-operator's
        own pin, whose shape is its own, is resolved again)."""
        try:
            provider = pinned["provider"]
            ref = provider.get("credentialsRef")
            return cls(
                workspace=str(pinned["name"]),
                provider=str(provider["name"]),
                kind=str(provider["kind"]),
                model=str(provider["model"]),
                base_url=str(provider["baseUrl"]),
                credentials=None if ref is None else (str(ref["secretName"]), str(ref["key"])),
                sources=tuple(
                    Source(str(s["name"]), str(s["repo"]), str(s["ref"]), str(s["path"]))
                    for s in pinned["sources"]
                ),
                env=tuple((str(e["name"]), str(e["value"])) for e in pinned.get("env", [])),
                runtime_class=(pinned.get("isolation") or {}).get("runtimeClass"),
            )
        except (KeyError, TypeError, AttributeError):
            return None

    def sources_json(self) -> str:
        import json

        return json.dumps(
            [{"name": s.name, "repo": s.repo, "ref": s.ref} for s in self.sources],
            separators=(",", ":"),
        )


def _invalid(name: str, message: str) -> WorkspaceProblem:
    return WorkspaceProblem("InvalidWorkspace", f"Workspace {name}: {message}")


def _sources(name: str, spec: Manifest) -> tuple[Source, ...]:
    items = spec.get("sources")
    if not isinstance(items, list) or not items:
        raise _invalid(name, "spec.sources must list at least one source")
    sources: list[Source] = []
    for item in items:
        if not isinstance(item, dict):
            raise _invalid(name, f"source {item!r} is not an object")
        source, repo, path = item.get("name"), item.get("repo"), item.get("path")
        ref = item.get("ref") or "main"
        if not isinstance(source, str) or not is_dns_label(source):
            raise _invalid(name, f"source name {source!r} is not a DNS label")
        if not isinstance(repo, str) or not repo:
            raise _invalid(name, f"source {source} has no repo")
        if not isinstance(ref, str):
            raise _invalid(name, f"source {source}: ref {ref!r} is not a string")
        if not isinstance(path, str) or not posixpath.isabs(path):
            raise _invalid(name, f"source {source}: path {path!r} is not an absolute path")
        path = posixpath.normpath(path)
        for reserved in RESERVED_PATHS:
            if path == reserved or path.startswith(reserved + "/") or reserved.startswith(path):
                raise _invalid(
                    name,
                    (
                        f"source {source}: path {path} overlaps {reserved}, which the daemon "
                        "container mounts itself"
                    ),
                )
        if source in {s.name for s in sources}:
            raise _invalid(name, f"source {source} is listed twice")
        if path in {s.path for s in sources}:
            raise _invalid(name, f"two sources are mounted at {path}")
        sources.append(Source(source, repo, ref, path))
    return tuple(sources)


def _env(name: str, spec: Manifest) -> tuple[tuple[str, str], ...]:
    items = spec.get("env") or []
    if not isinstance(items, list):
        raise _invalid(name, "spec.env must be a list")
    env = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise _invalid(name, f"env entry {item!r} has no name")
        if item["name"] in (BASE_URL_ENV, API_KEY_ENV, SOURCES_ENV):
            raise _invalid(name, f"env {item['name']} is set from the provider and sources")
        env.append((item["name"], str(item.get("value", ""))))
    return tuple(env)


def _providers(name: str, spec: Manifest) -> dict[str, Manifest]:
    """The Workspace's providers by name; each name once (a task names one by it)."""
    providers = spec.get("providers")
    if not isinstance(providers, list) or not providers:
        raise _invalid(name, "spec.providers must list at least one provider")
    by_name: dict[str, Manifest] = {}
    for provider in providers:
        if not isinstance(provider, dict) or not isinstance(provider.get("name"), str):
            raise _invalid(name, f"provider {provider!r} has no name")
        if provider["name"] in by_name:
            raise _invalid(name, f"provider {provider['name']} is listed twice")
        by_name[provider["name"]] = provider
    return by_name


def _chosen(name: str, spec: Manifest, provider_ref: str | None) -> Manifest:
    by_name = _providers(name, spec)
    if provider_ref is not None:
        wanted, why = provider_ref, "spec.providerRef"
    elif spec.get("defaultProvider"):
        wanted, why = spec["defaultProvider"], f"Workspace {name}'s defaultProvider"
    elif len(by_name) == 1:
        return next(iter(by_name.values()))
    else:
        raise WorkspaceProblem(
            "NoDefaultProvider",
            (
                f"Workspace {name} has {len(by_name)} providers and no defaultProvider: set "
                "spec.providerRef to one of " + ", ".join(sorted(map(str, by_name)))
            ),
        )
    if wanted not in by_name:
        raise WorkspaceProblem(
            "ProviderNotFound",
            (
                f"{why} names provider {wanted!r}, which Workspace {name} does not define "
                "(it has " + ", ".join(sorted(map(str, by_name))) + ")"
            ),
        )
    return by_name[wanted]


def _base_url(name: str, provider: Manifest, kind: str) -> str:
    base = provider.get("baseUrl")
    if base is not None and not isinstance(base, str):
        raise _invalid(name, f"provider {provider['name']}: baseUrl is not a string")
    if not base:
        if kind != "ollama":
            raise WorkspaceProblem(
                "ProviderNeedsBaseUrl",
                (
                    f"provider {provider['name']} of Workspace {name} (kind {kind}) has no "
                    "baseUrl; caliban-drain configures no remote endpoint by default"
                ),
            )
        base = OLLAMA_DEFAULT_URL
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _invalid(name, f"provider {provider['name']}: baseUrl {base!r} is not an http URL")
    base = base.rstrip("/")
    if kind == "ollama" and not parts.path.rstrip("/").endswith("/v1"):
        base += "/v1"  # ollama's OpenAI-compatible API
    return base


def resolve(
    workspace: Manifest | None, name: str, provider_ref: str | None, task_model: str
) -> Binding:
    """The binding of a task to Workspace ``name`` (``workspace`` as the API returned it,
    None when there is none), or WorkspaceProblem saying why there is none."""
    if workspace is None:
        raise WorkspaceProblem(
            "WorkspaceNotFound",
            (
                f"spec.workspaceRef names Workspace {name}, which does not exist in the "
                "task's namespace; the task starts once it does"
            ),
        )
    spec = workspace.get("spec")
    if not isinstance(spec, dict):
        raise _invalid(name, "it has no spec")
    provider = _chosen(name, spec, provider_ref)
    kind, base_url, credentials = _driven(
        name, provider, "nothing was started: pick another provider with spec.providerRef"
    )
    model = task_model or provider.get("model") or ""
    if not isinstance(model, str) or not model:
        raise _invalid(name, f"provider {provider['name']} has no model, nor does spec.task")
    return Binding(
        workspace=name,
        provider=str(provider["name"]),
        kind=kind,
        model=model,
        base_url=base_url,
        credentials=credentials,
        sources=_sources(name, spec),
        env=_env(name, spec),
        runtime_class=_runtime_class(name, spec),
    )


def _driven(name: str, provider: Manifest, refused: str) -> tuple[str, str, tuple[str, str] | None]:
    """How the daemon drives ``provider``: (its kind, lower-case; the API root its agents
    call; (Secret name, key) of its API key or None), or why it cannot (a kind it does
    not drive: ``refused`` says what follows)."""
    kind = provider.get("kind")
    if not isinstance(kind, str) or not kind:
        raise _invalid(name, f"provider {provider.get('name')} has no kind")
    if kind.lower() not in DRIVEN_KINDS:
        raise WorkspaceProblem(
            "UnsupportedProviderKind",
            (
                f"provider {provider['name']} of Workspace {name} is of kind {kind}, which "
                f"caliban-drain cannot drive yet (it drives {', '.join(DRIVEN_KINDS)}); " + refused
            ),
        )
    ref = provider.get("credentialsRef")
    credentials = None
    if ref is not None:
        if not isinstance(ref, dict) or not ref.get("secretName") or not ref.get("key"):
            raise _invalid(
                name, f"provider {provider['name']}: credentialsRef needs secretName and key"
            )
        credentials = (str(ref["secretName"]), str(ref["key"]))
    return kind.lower(), _base_url(name, provider, kind.lower()), credentials


def validate(workspace: Manifest) -> None:
    """Whether every task bound to ``workspace`` could be started, whichever provider it
    picks: WorkspaceProblem with the first thing that keeps one from it, as ``resolve``
    would say it (the reasons are the same). Its providers each once, the
    ``defaultProvider`` one of them, every provider of a kind the daemon drives with what
    that kind needs, every source and env entry usable. A provider's ``model`` may be
    missing (a task may name its own), and a ``credentialsRef`` is checked for its shape
    only: the operator never reads a tenant's Secret."""
    name = str((workspace.get("metadata") or {}).get("name", ""))
    spec = workspace.get("spec")
    if not isinstance(spec, dict):
        raise _invalid(name, "it has no spec")
    providers = _providers(name, spec)
    default = spec.get("defaultProvider")
    if default and default not in providers:
        raise WorkspaceProblem(
            "ProviderNotFound",
            (
                f"Workspace {name}'s defaultProvider names provider {default!r}, which it "
                "does not define (it has " + ", ".join(sorted(providers)) + ")"
            ),
        )
    for provider in providers.values():
        _driven(name, provider, "a task bound to it is refused")
    _sources(name, spec)
    _env(name, spec)
    _runtime_class(name, spec)


def _runtime_class(name: str, spec: Manifest) -> str | None:
    isolation = spec.get("isolation") or {}
    if not isinstance(isolation, dict):
        raise _invalid(name, "isolation must be an object")
    runtime_class = isolation.get("runtimeClass") or None
    if runtime_class is not None and not isinstance(runtime_class, str):
        raise _invalid(name, f"isolation.runtimeClass {runtime_class!r} is not a name")
    return runtime_class


def pod_parts(binding: Binding, image: str) -> Manifest:
    """What a binding adds to the daemon's pod: the env its agents read the provider
    from (the key through ``secretKeyRef``), the sources' mounts, and the init container
    that clones them (``drainctl sources``)."""
    env: list[Manifest] = [{"name": BASE_URL_ENV, "value": binding.base_url}]
    if binding.credentials is not None:
        secret, key = binding.credentials
        env.append(
            {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
        )
    env += [{"name": n, "value": v} for n, v in binding.env]
    mounts = [
        {"name": "workspace", "mountPath": s.path, "subPath": f"{crd.SOURCES_DIR}/{s.name}"}
        for s in binding.sources
    ]
    init = {
        "name": "sources",
        "image": image,
        "command": ["drainctl"],
        "args": ["sources", "--into", f"{crd.WORKSPACE_MOUNT}/{crd.SOURCES_DIR}"],
        "env": [{"name": SOURCES_ENV, "value": binding.sources_json()}],
        "securityContext": copy.deepcopy(crd.CONTAINER_SECURITY_CONTEXT),
        "volumeMounts": [
            {"name": "workspace", "mountPath": crd.WORKSPACE_MOUNT},
            {"name": crd.TMP_VOLUME, "mountPath": crd.TMP_MOUNT},
        ],
    }
    return {"env": env, "volumeMounts": mounts, "initContainers": [init]}


_SCHEME_PORTS: Final = {"http": 80, "https": 443, "ssh": 22, "git": 9418}
_SCP_LIKE: Final = re.compile(r"^[^@/:\s]+@[^:/\s]+:(?!//)")


def _url_port(url: str) -> int | None:
    """The TCP port a provider or git URL connects to; None for a local path or file://."""
    if _SCP_LIKE.match(url):
        return 22  # git's scp-like ssh syntax, user@host:path
    parts = urlsplit(url)
    if parts.scheme in ("", "file"):
        return None
    try:
        port = parts.port
    except ValueError:
        return None
    return port if port is not None else _SCHEME_PORTS.get(parts.scheme.split("+")[-1])


def egress_ports(binding: Binding) -> tuple[int, ...]:
    """The TCP ports the task's pod must reach for its Workspace: its provider's and its
    sources' remotes (sorted, once each), for the task's NetworkPolicy."""
    urls = [binding.base_url, *(s.repo for s in binding.sources)]
    return tuple(sorted({p for p in map(_url_port, urls) if p is not None}))
