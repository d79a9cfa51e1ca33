"""``drainctl operator|pause|wake``: the commands that talk to the Kubernetes API.

``pause`` and ``wake`` are what a user would otherwise do with ``kubectl patch``: they
set ``spec.lifecycle.suspend`` (and, for wake, the wake annotation) with one merge patch,
and the operator does the rest. They take ``--kubeconfig``/``--context`` like kubectl;
without either they use in-cluster credentials in a pod, else ``KUBECONFIG`` or
``~/.kube/config``. No kubeconfig exits 2, an unreachable API 4 (``errors.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import click

from orchestrator.cli.errors import OperationFailed
from orchestrator.cli.output import (
    TASK_REF,
    configure_logging,
    emit,
    json_option,
    log_level_option,
)
from orchestrator.operator.crd import GROUP, PLURAL, VERSION

F = TypeVar("F", bound=Callable[..., Any])


API_TIMEOUT_SECS: Final = 10.0
"""Connect and read timeout of each call pause/wake make."""


@click.command("operator")
@click.option("--manage-sandbox", is_flag=True, help="Provision each task's Sandbox and PVC.")
@click.option(
    "--existing-sandboxes",
    is_flag=True,
    help="Sandboxes are provisioned elsewhere (caliban-operator's <task>-sbx, or "
    "spec.sandbox.name): drain, suspend and resume them, never create one "
    "(DRAIN_EXISTING_SANDBOXES).",
)
@click.option(
    "--namespace", "namespaces", multiple=True, help="Watch only this namespace (repeatable)."
)
@click.option(
    "--peering",
    default=None,
    metavar="NAME",
    help="Run as one of several replicas sharing the kopf peering object NAME (a "
    "ClusterKopfPeering; a KopfPeering per namespace with --namespace): one acts, the others "
    "stand by (DRAIN_PEERING; default: standalone, one replica).",
)
@click.option(
    "--liveness",
    default=None,
    metavar="URL",
    callback=lambda _ctx, _param, value: _liveness_url(value),
    help="Serve kopf's liveness probe at URL, e.g. http://0.0.0.0:8080/healthz.",
)
@log_level_option
def operator_cmd(
    manage_sandbox: bool,
    existing_sandboxes: bool,
    namespaces: tuple[str, ...],
    peering: str | None,
    liveness: str | None,
    log_level: str,
) -> None:
    """Run the CalibanTask operator (kopf; kubeconfig or in-cluster credentials)."""
    configure_logging(log_level)
    from orchestrator.operator.main import run_operator
    from orchestrator.operator.permissions import find_missing

    try:
        run_operator(
            namespaces=list(namespaces) or None,
            manage_sandbox=manage_sandbox,
            existing_sandboxes=existing_sandboxes,
            peering=peering,
            liveness=liveness,
        )
    except Exception as exc:  # kopf wraps the startup check's refusal in its own error
        missing = find_missing(exc)
        if missing is None:
            raise
        raise OperationFailed(str(missing)) from None


def _liveness_url(value: str | None) -> str | None:
    """``--liveness``: an http URL with a host, a port and a path (kopf serves only http)."""
    if value is None:
        return None
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or not parts.path:
        raise click.BadParameter(
            f"{value!r} is not an http URL with a host, a port and a path, "
            "e.g. http://0.0.0.0:8080/healthz"
        )
    return value


def kube_options(command: F) -> F:
    command = click.option(
        "--context",
        default=None,
        help="The kubeconfig context to use (default: its current context).",
    )(command)
    return click.option(
        "--kubeconfig",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None,
        help="Kubeconfig file (default: in-cluster, else KUBECONFIG or ~/.kube/config).",
    )(command)


def load_kube(kubeconfig: Path | None, context: str | None) -> None:
    """Point the Kubernetes client's default configuration, which the operator's own
    calls (``orchestrator.operator.kube``) use, at in-cluster credentials or the
    kubeconfig; one attempt per call, so an unreachable API is reported at once."""
    from kubernetes import client, config

    loaded = False
    if kubeconfig is None and context is None:
        with contextlib.suppress(config.ConfigException):
            config.load_incluster_config()
            loaded = True
    if not loaded:
        # ConfigException (no kubeconfig, unknown context) → exit 2 in errors.py.
        config.load_kube_config(
            config_file=str(kubeconfig) if kubeconfig else None, context=context
        )
    configuration = client.Configuration.get_default_copy()
    configuration.retries = 0
    client.Configuration.set_default(configuration)


def _patch_task(
    task: tuple[str, str], patch: dict[str, Any], kubeconfig: Path | None, context: str | None
) -> dict[str, Any]:
    """One merge patch of the CalibanTask ``task``; the patched object is returned."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    namespace, name = task
    api_client = None
    if kubeconfig is None and context is None:
        # Not in a pod: a kubeconfig, below.
        with contextlib.suppress(config.ConfigException):
            config.load_incluster_config()
            api_client = client.ApiClient()
    if api_client is None:
        # ConfigException (no kubeconfig, unknown context) → exit 2 in errors.py.
        api_client = config.new_client_from_config(
            config_file=str(kubeconfig) if kubeconfig else None, context=context
        )
    # One attempt per call: an unreachable API is reported at once, not after retries.
    api_client.configuration.retries = 0
    with api_client:
        api = client.CustomObjectsApi(api_client)
        try:
            result: dict[str, Any] = api.patch_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                patch,
                _content_type="application/merge-patch+json",
                _request_timeout=API_TIMEOUT_SECS,
            )
        except ApiException as exc:
            hint = f" (does it exist? kubectl get {PLURAL} -n {namespace})"
            raise OperationFailed(
                f"calibantask {namespace}/{name}: the API answered {exc.status} {exc.reason}"
                + (hint if exc.status == 404 else "")
            ) from None
    return result


@click.command("pause")
@click.argument("task", type=TASK_REF)
@kube_options
@json_option
def pause_cmd(task: tuple[str, str], kubeconfig: Path | None, context: str | None) -> None:
    """Pause TASK (NS/NAME): drain, checkpoint, suspend (sets spec.lifecycle.suspend)."""
    patched = _patch_task(task, {"spec": {"lifecycle": {"suspend": True}}}, kubeconfig, context)
    emit(patched, f"calibantask {task[0]}/{task[1]} pausing")


@click.command("wake")
@click.argument("task", type=TASK_REF)
@kube_options
@json_option
def wake_cmd(task: tuple[str, str], kubeconfig: Path | None, context: str | None) -> None:
    """Resume TASK (NS/NAME) from its checkpoint (clears suspend, sets the wake annotation)."""
    from datetime import UTC, datetime

    from orchestrator.operator.crd import WAKE_ANNOTATION

    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    patch = {
        "metadata": {"annotations": {WAKE_ANNOTATION: stamp}},
        "spec": {"lifecycle": {"suspend": False}},
    }
    patched = _patch_task(task, patch, kubeconfig, context)
    emit(patched, f"calibantask {task[0]}/{task[1]} waking")
