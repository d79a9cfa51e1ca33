"""The CalibanTask spec as the operator runs it: ``parse_spec`` validates and defaults
it the way the CRD schema does (for objects that reach the operator without it) and
refuses what this operator cannot honour, naming the field (``SpecError``);
``admit_spec`` adds the operator's own rules (allowed images, Sandboxes another
controller makes). ``TaskSpec`` is the parsed, flattened spec every decision reads."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from orchestrator.operator.crd import (
    BROKER_URL_ENV,
    DAEMON_CONTAINER,
    GROUP,
    SANDBOX_API_VERSIONS,
    Manifest,
    upstream_sandbox_name,
)
from orchestrator.operator.lifecycle.declared import CalibanTaskSpec, DeclaredError, EnvVar
from orchestrator.operator.workspace import DAEMON_PROVIDER, Binding
from worker_agent.k8s_names import is_dns_label, is_dns_subdomain
from worker_agent.logformat import LOG_FORMAT_ENV
from worker_agent.signing import TASK_KEY_ENV

RESERVED_ENV: Final = frozenset({BROKER_URL_ENV, LOG_FORMAT_ENV, TASK_KEY_ENV})
"""The daemon container's own variables: a ``spec.task.env`` entry may not set them."""

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(ms|s|m|h|d))+$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_SECS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
ON_DELETE_VALUES: Final = ("checkpoint", "delete")
"""``spec.lifecycle.onDelete``, compared case-insensitively: caliban-operator's schema
takes any string, and its users write ``Checkpoint``/``Delete`` too."""

MAX_PROMPT_BYTES: Final = 128 * 1024 - len("CALIBAN_INITIAL_PROMPT=") - 1
"""The longest ``spec.task.prompt`` (UTF-8 bytes) the daemon can pass on: it reaches the
daemon as one argument (``--initial-prompt``) and each agent as the environment entry
``CALIBAN_INITIAL_PROMPT=<prompt>``, and Linux refuses to exec a process with any single
argument or entry over 128 KiB (``MAX_ARG_STRLEN``, counting its NUL). A longer prompt
would leave every agent failing to launch, so ``parse_spec`` refuses it instead."""


class SpecError(ValueError):
    """A CalibanTask spec field that cannot be honoured; ``field`` is its path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"spec.{field}: {message}")
        self.field = field

    @property
    def reason(self) -> str:
        """The condition and event reason naming the field: ``lifecycle.onDelete`` →
        ``InvalidLifecycleOnDelete``."""
        words = re.split(r"[^A-Za-z0-9]+", self.field)
        return "Invalid" + "".join(w[:1].upper() + w[1:] for w in words if w)


def parse_duration(value: object, field: str) -> float:
    """``"90s"``, ``"2m"``, ``"1h30m"``, ``"500ms"``, ``"1d"`` → seconds."""
    if not isinstance(value, str) or not _DURATION.match(value):
        raise SpecError(field, f"{value!r} is not a duration like 30s, 2m, 1h30m or 1d")
    return sum(float(n) * _UNIT_SECS[unit] for n, unit in _DURATION_PART.findall(value))


@dataclass(frozen=True)
class TaskSpec:
    agents: int
    provider: str
    model: str
    prompt: str | None
    idle_timeout_secs: float | None
    on_delete: str
    drain_grace_secs: float
    drain_timeout_secs: float
    suspend: bool
    resume_from: str | None
    sandbox_api_version: str | None
    """``spec.sandbox.apiVersion``; None where unset, until the operator resolves it
    (:func:`sandbox_api_version_choice`, :meth:`with_sandbox_api_version`): read
    :attr:`sandbox_version` once resolved."""
    storage: str
    sandbox_name: str | None = None
    """``spec.sandbox.name``: an existing Sandbox to operate on (never created)."""
    image: str | None = None
    """``spec.task.image``: the daemon container's image, over the operator's default."""
    env: tuple[tuple[str, str], ...] = ()
    """``spec.task.env`` (name, value), appended to the daemon container's env."""
    storage_class: str | None = None
    """``spec.workspace.storageClassName`` for the workspace PVC."""
    pod_template: Manifest = field(default_factory=dict, hash=False)
    """``spec.sandbox.podTemplate`` (``metadata`` and ``spec``), merged under the pod
    template the operator generates (``children.merge_under``)."""
    workspace_ref: str | None = None
    """``spec.workspaceRef.name``: the Workspace whose sources and provider the task uses."""
    provider_ref: str | None = None
    """``spec.providerRef``: which of the Workspace's providers (else its default)."""
    binding: Binding | None = field(default=None, hash=False)
    """The resolved Workspace (``with_binding``); its provider and model are the task's."""
    runtime_class: str | None = None
    """``spec.isolation.runtimeClass``: the pod's ``runtimeClassName`` (over the
    Workspace's default, ``Binding.runtime_class``)."""
    upstream_env: tuple[tuple[str, str], ...] = ()
    """The daemon container's variables caliban-operator sets from the spec
    (``UPSTREAM_ENV``): ``GONZALO_ENDPOINT``, ``CALIBAN_ROUTER_CONFIG_REF``."""
    declared: CalibanTaskSpec = field(default_factory=CalibanTaskSpec, hash=False, compare=False)
    """The spec as declared, every field of it, acted on or not (``unhonoured``)."""

    @property
    def sandbox_version(self) -> str:
        """The Sandbox API version the task talks to its Sandbox in; only a resolved spec
        has one (an unresolved one never silently means either version)."""
        if self.sandbox_api_version is None:
            raise ValueError("spec.sandbox.apiVersion is not resolved yet")
        return self.sandbox_api_version

    def with_sandbox_api_version(self, api_version: str) -> TaskSpec:
        """This spec with its Sandbox API version resolved to ``api_version``."""
        return replace(self, sandbox_api_version=api_version)

    def with_binding(self, binding: Binding) -> TaskSpec:
        """This spec run against ``binding``: the daemon's OpenAI-compatible provider with
        the Workspace provider's model."""
        return replace(self, binding=binding, provider=DAEMON_PROVIDER, model=binding.model)


def on_existing_sandbox(spec: TaskSpec, task: str, existing_sandboxes: bool) -> TaskSpec:
    """``spec`` as the operator runs it: where Sandboxes are provisioned elsewhere
    (``DRAIN_EXISTING_SANDBOXES``), a task that names no Sandbox runs in the one
    caliban-operator makes for it, ``<task>-sbx``, exactly as if ``spec.sandbox.name``
    named it: waited for, drained, suspended and resumed, never created."""
    if not existing_sandboxes or spec.sandbox_name is not None:
        return spec
    return replace(spec, sandbox_name=upstream_sandbox_name(task))


def admit_spec(
    spec: Manifest, task: str, *, images: Sequence[str], existing_sandboxes: bool
) -> TaskSpec:
    """The task's spec as this operator runs it: parsed (``parse_spec``), its image one
    of ``images`` (the operator's own first, then ``DRAIN_ALLOWED_IMAGES``), and its
    Sandbox the one another controller made where the operator only operates on them
    (``on_existing_sandbox``); a ``SpecError`` names what is wrong."""
    parsed = parse_spec(spec)
    if parsed.image is not None and parsed.image not in images:
        raise SpecError(
            "task.image",
            (
                f"{parsed.image} is not an image this operator runs (DRAIN_ALLOWED_IMAGES: "
                f"{', '.join(images)})"
            ),
        )
    return on_existing_sandbox(parsed, task, existing_sandboxes)


def parse_spec(spec: Manifest) -> TaskSpec:
    """The spec as declared (``CalibanTaskSpec.read``: its types and the CRD's defaults,
    for objects that reach the operator without the schema: an older CRD, a server
    without structural defaults), then what a schema cannot say: durations, checkpoint
    refs and names, the pod template's allow-list, reserved variables, and what
    caliban-operator's schema admits but this operator cannot honour (an unknown
    ``onDelete``, an unreadable ``idleTimeout``, a prompt over ``MAX_PROMPT_BYTES``)."""
    try:
        declared = CalibanTaskSpec.read(spec)
    except DeclaredError as exc:
        raise SpecError(exc.field, str(exc)) from None
    task, lifecycle, sandbox = declared.task, declared.lifecycle, declared.sandbox
    if not task.provider:
        raise SpecError("task.provider", f"{task.provider!r} is not a provider name")
    prompt = task.prompt
    if prompt is not None and len(prompt.encode()) > MAX_PROMPT_BYTES:
        raise SpecError(
            "task.prompt",
            (
                f"{len(prompt.encode())} bytes is longer than the {MAX_PROMPT_BYTES} bytes the "
                "daemon can pass to an agent (a process argument is capped at 128 KiB); "
                "shorten it, or put the long text in the workspace and point the prompt at it"
            ),
        )
    idle = lifecycle.idle_timeout
    idle_timeout = None if idle is None else parse_duration(idle, "lifecycle.idleTimeout")
    on_delete = lifecycle.on_delete.lower()
    if on_delete not in ON_DELETE_VALUES:
        raise SpecError(
            "lifecycle.onDelete", f"{lifecycle.on_delete!r} is not checkpoint or delete"
        )
    grace = parse_duration(lifecycle.drain_grace_period, "lifecycle.drainGracePeriod")
    timeout = parse_duration(lifecycle.drain_timeout, "lifecycle.drainTimeout")
    ref = declared.resume_from.checkpoint_ref if declared.resume_from else None
    if ref is not None and not is_dns_label(ref):
        raise SpecError("resumeFrom.checkpointRef", f"{ref!r} is not a checkpoint ref")
    if sandbox.api_version is not None and sandbox.api_version not in SANDBOX_API_VERSIONS:
        raise SpecError(
            "sandbox.apiVersion", f"{sandbox.api_version!r} is not a Sandbox API version"
        )
    if sandbox.name is not None and not is_dns_label(sandbox.name):
        raise SpecError("sandbox.name", f"{sandbox.name!r} is not a Sandbox name (a DNS label)")
    env = _parse_env(task.env)
    workspace_ref = declared.workspace_ref.name if declared.workspace_ref else None
    if workspace_ref is not None and not is_dns_subdomain(workspace_ref):
        raise SpecError(
            "workspaceRef.name",
            (
                f"{workspace_ref!r} is not a Workspace name (a lowercase DNS subdomain), so no "
                "Workspace can have it"
            ),
        )
    provider_ref = declared.provider_ref or None  # "" is unset, as upstream reads it
    if provider_ref is not None and workspace_ref is None:
        raise SpecError("providerRef", "names a Workspace provider, but there is no workspaceRef")
    if prompt == "":
        raise SpecError("task.prompt", "is empty: give the agents a prompt, or leave it out")
    if workspace_ref is not None and prompt is None:
        raise SpecError("task.prompt", (
            "is required with a workspaceRef: caliban-operator's agents start from it "
            "(only a task running this operator's own providers may leave it out)"
        ))  # fmt: skip
    return TaskSpec(
        agents=task.agents,
        provider=task.provider,
        model=task.model or "",
        prompt=prompt,
        idle_timeout_secs=idle_timeout,
        on_delete=on_delete,
        drain_grace_secs=grace,
        drain_timeout_secs=timeout,
        suspend=lifecycle.suspend,
        resume_from=ref,
        sandbox_api_version=sandbox.api_version,
        storage=declared.workspace.storage,
        sandbox_name=sandbox.name,
        image=task.image or None,
        env=env,
        storage_class=declared.workspace.storage_class_name or None,
        pod_template=_parse_pod_template(sandbox.pod_template),
        workspace_ref=workspace_ref,
        provider_ref=provider_ref,
        runtime_class=(declared.isolation.runtime_class if declared.isolation else None) or None,
        upstream_env=_upstream_env(declared),
        declared=declared,
    )


def _upstream_env(declared: CalibanTaskSpec) -> tuple[tuple[str, str], ...]:
    """The spec fields caliban-operator hands the daemon container as variables, under
    its names (its ``caliband_env``)."""
    values = {
        "GONZALO_ENDPOINT": declared.state.gonzalo_endpoint if declared.state else None,
        "CALIBAN_ROUTER_CONFIG_REF": (declared.model.router_config_ref if declared.model else None),
    }
    return tuple((name, value) for name, value in values.items() if value)


UNHONOURED: Final = (
    ("task", "agentType"), ("task", "interactive"), ("state", "mode"), ("state", "tokenRef"),
    ("isolation", "worktrees"), ("resources", "class"), ("tools",),
)  # fmt: skip
"""Fields of caliban-operator's spec this operator takes but does not act on (yet): a task
setting one runs without it, and is told so (``SpecHonoured=False``)."""


def unhonoured(spec: TaskSpec) -> tuple[str, ...]:
    """The fields of ``spec`` set that this operator does not act on, as ``spec.…`` paths."""
    raw = spec.declared.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
    found = []
    for path in UNHONOURED:
        value: object = raw
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value not in (None, [], ""):
            found.append("spec." + ".".join(path))
    return tuple(found)


POD_TEMPLATE_ALLOWED: Final = (
    "metadata.labels, metadata.annotations, spec.nodeSelector, spec.affinity, "
    f"spec.tolerations and the resources of container {DAEMON_CONTAINER}"
)
"""What ``spec.sandbox.podTemplate`` may set: where the pod is scheduled, what it is
labelled, how much it may use. Everything else about the pod is the operator's (its
identity, volumes, security context, containers): whoever may create a task gets agents
in a sandbox, not a pod of their choosing (docs/security.md)."""
_RESERVED_KEY_DOMAINS = (
    GROUP + "/", "app.kubernetes.io/", "apparmor.security.beta.kubernetes.io/",
    "seccomp.security.alpha.kubernetes.io/", "kubernetes.io/", "k8s.io/",
)  # fmt: skip
"""Label and annotation key prefixes (or ``<prefix>`` after a ``.``) a task may not set on
its pod: ours, and the cluster's own, security annotations (AppArmor, seccomp) among them."""
_TOLERATION_KEYS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})
_RESOURCE_KEYS = frozenset({"limits", "requests"})


def _parse_pod_template(template: Any) -> Manifest:
    """``spec.sandbox.podTemplate``, taken only as far as ``POD_TEMPLATE_ALLOWED`` goes: a
    field outside it is refused, named, rather than dropped."""
    if template is None:
        return {}
    at = "sandbox.podTemplate"
    _require_object(template, at)
    _only(template, {"metadata", "spec"}, at)
    metadata = template.get("metadata", {})
    _require_object(metadata, f"{at}.metadata")
    _only(metadata, {"labels", "annotations"}, f"{at}.metadata")
    for key in ("labels", "annotations"):
        _string_map(metadata.get(key), f"{at}.metadata.{key}", reserved=True)
    pod = template.get("spec", {})
    _require_object(pod, f"{at}.spec")
    _only(pod, {"nodeSelector", "affinity", "tolerations", "containers"}, f"{at}.spec")
    _string_map(pod.get("nodeSelector"), f"{at}.spec.nodeSelector", reserved=False)
    if "affinity" in pod:
        _require_object(pod["affinity"], f"{at}.spec.affinity")
    _parse_tolerations(pod.get("tolerations"), f"{at}.spec.tolerations")
    containers = pod.get("containers") or []
    if not isinstance(containers, list):
        raise SpecError(f"{at}.spec.containers", "must be a list")
    for n, container in enumerate(containers):
        where = f"{at}.spec.containers[{n}]"
        _require_object(container, where)
        if container.get("name") != DAEMON_CONTAINER:
            raise SpecError(
                f"{where}.name",
                (
                    f"{container.get('name')!r}: the pod runs one container, "
                    f"{DAEMON_CONTAINER!r}; only its resources may be set"
                ),
            )
        _only(container, {"name", "resources"}, where)
        resources = container.get("resources") or {}
        _require_object(resources, f"{where}.resources")
        _only(resources, _RESOURCE_KEYS, f"{where}.resources")
    taken: Manifest = template
    return taken


def _require_object(value: object, at: str) -> None:
    if not isinstance(value, dict):
        raise SpecError(at, f"must be an object, not {type(value).__name__}")


def _only(obj: Manifest, allowed: Collection[str], at: str) -> None:
    """Refuse the first key of ``obj`` outside ``allowed``, naming it."""
    for key in sorted(set(obj) - set(allowed)):
        raise SpecError(
            f"{at}.{key}",
            (
                f"is not allowed: a task's pod template takes only {POD_TEMPLATE_ALLOWED}; the "
                "rest of the pod is the operator's"
            ),
        )


def _string_map(value: object, at: str, *, reserved: bool) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise SpecError(at, "must map names to strings")
    for key in value if reserved else ():
        prefix = key.rpartition("/")[0] + "/" if "/" in key else ""
        if any(prefix == d or prefix.endswith("." + d) for d in _RESERVED_KEY_DOMAINS):
            raise SpecError(
                at,
                (
                    f"{key!r} is in a domain the operator or the cluster keeps for itself "
                    f"({prefix[:-1]}); use a key of your own"
                ),
            )


def _parse_tolerations(value: object, at: str) -> None:
    if value is None:
        return
    if not isinstance(value, list):
        raise SpecError(at, "must be a list")
    for n, toleration in enumerate(value):
        _require_object(toleration, f"{at}[{n}]")
        _only(toleration, _TOLERATION_KEYS, f"{at}[{n}]")
        if not isinstance(toleration.get("key"), str) or not toleration["key"]:
            raise SpecError(
                f"{at}[{n}].key",
                (
                    "is required: a toleration without a key (operator Exists) tolerates every "
                    "taint, which would let the pod onto any node"
                ),
            )


def _parse_env(env: Sequence[EnvVar]) -> tuple[tuple[str, str], ...]:
    """``spec.task.env`` as (name, value) pairs; one naming a variable the daemon's own
    container sets (``RESERVED_ENV``) is refused, as it would silently lose."""
    for item in env:
        if not item.name:
            raise SpecError("task.env", f"{item.model_dump()!r} has no variable name")
        if item.name in RESERVED_ENV:
            raise SpecError(
                "task.env", f"{item.name} is set by the operator and cannot be overridden"
            )
    return tuple((item.name, item.value or "") for item in env)
