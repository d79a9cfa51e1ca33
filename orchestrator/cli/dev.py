"""``drainctl dev up|cluster|controller``: the embedded Kubernetes API and the whole stack
on one machine, for development (``controller``: the stand-in Sandbox controller alone,
against an API already running, as the compose stack runs it). ``orchestrator.devcluster``
(and kmock behind it) is imported inside the commands only, so it is needed only when
they run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from orchestrator.cli.errors import OperationFailed, require_extra
from orchestrator.cli.output import configure_logging, log_level_option


@click.group()
def dev() -> None:
    """Development: the embedded Kubernetes API and the whole stack on one machine."""
    require_extra("dev", "kmock", "the embedded Kubernetes API (drainctl dev)")


@dev.command("up")
@click.option(
    "--kubeconfig",
    type=click.Path(path_type=Path),
    default=Path("kubeconfig.yaml"),
    show_default=True,
    help="Where to write the kubeconfig for kubectl.",
)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    default=Path(".dev-stack"),
    show_default=True,
    help="Ledger, broker, volumes and logs.",
)
@click.option("--port", default=0, show_default=True, type=int, help="API port (0: any).")
@click.option(
    "--sandbox-storage",
    type=click.Choice(["v1beta1", "v1alpha1"]),
    default="v1beta1",
    show_default=True,
    help="The Sandbox API the embedded cluster has. v1beta1: agent-sandbox's CRD as "
    "released (stores v1beta1, serves v1alpha1 deprecated, converts between them). "
    "v1alpha1: a cluster whose agent-sandbox predates v1beta1 (serves and stores v1alpha1 "
    "only).",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="Start with an empty Kubernetes API: discard the objects saved in the state dir "
    "(the ledger and the volumes stay).",
)
@click.option(
    "--snapshots/--no-snapshots",
    default=True,
    show_default=True,
    help="Serve CSI volume snapshots (snapshot.storage.k8s.io: the VolumeSnapshot CRDs, a "
    "default VolumeSnapshotClass and a stand-in CSI driver that copies volumes), as a "
    "cluster with CSI snapshot support does. --no-snapshots: a cluster without them "
    "(snapshot CRDs saved in the state dir are removed, their objects with them).",
)
@click.option(
    "--snapshot-ready-delay",
    "snapshot_ready_delay",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    envvar="DRAIN_DEV_SNAPSHOT_READY_DELAY_SECS",
    metavar="SECONDS",
    help="Seconds from a VolumeSnapshot's cut (creationTime set, content bound: at once) "
    "until the stand-in CSI driver makes it readyToUse, as a real driver uploads a "
    "snapshot for minutes (default from DRAIN_DEV_SNAPSHOT_READY_DELAY_SECS; 0: ready at "
    "the cut).",
)
@click.option(
    "--operator/--no-operator",
    default=True,
    show_default=True,
    help="Run the operator. --no-operator: run your own against the kubeconfig, e.g. two "
    "replicas with drainctl operator --manage-sandbox --peering NAME (the stack serves "
    "kopf's peering CRDs; create the peering object NAME first).",
)
@click.option(
    "--rbac",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Authorize by RBAC: apply this file's RBAC objects (deploy/base/rbac.yaml) and run "
    "the operator as its ServiceAccount, refused what they do not grant.",
)
@click.option(
    "--record-requests",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write each API request's user, verb, group, resource, namespace and name to this "
    "file as a JSON line.",
)
@log_level_option
def dev_up(
    kubeconfig: Path,
    state_dir: Path,
    port: int,
    sandbox_storage: str,
    fresh: bool,
    snapshots: bool,
    snapshot_ready_delay: float,
    operator: bool,
    rbac: Path | None,
    record_requests: Path | None,
    log_level: str,
) -> None:
    """Embedded API, operator, worker, stand-in Sandbox controller, ledger and broker.

    The API's objects survive a restart on the same --state-dir (--fresh discards them)."""
    configure_logging(log_level)
    from orchestrator.devcluster import DevClusterError
    from orchestrator.devcluster.up import run_dev_up

    try:
        asyncio.run(
            run_dev_up(
                kubeconfig=kubeconfig.resolve(),
                state_dir=state_dir.resolve(),
                port=port,
                sandbox_storage=sandbox_storage,
                fresh=fresh,
                snapshots=snapshots,
                operator=operator,
                rbac=rbac.resolve() if rbac else None,
                record_requests=record_requests.resolve() if record_requests else None,
                snapshot_ready_delay_secs=snapshot_ready_delay,
            )
        )
    except DevClusterError as exc:
        raise OperationFailed(str(exc)) from None


@dev.command("cluster")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="Port on 127.0.0.1 (0 picks a free one).",
)
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Where to write the kubeconfig for kubectl and kopf.",
)
@click.option(
    "--crd",
    "crd_files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A CRD file to serve from the start (default: the CRDs the package ships, with "
    "the CSI volume snapshot ones; no snapshot driver runs here, so snapshots stay unready).",
)
@log_level_option
def dev_cluster(port: int, kubeconfig: Path, crd_files: tuple[Path, ...], log_level: str) -> None:
    """Run the embedded Kubernetes API alone, in the foreground, until SIGTERM or Ctrl-C."""
    from orchestrator.devcluster import DevClusterError, run_dev_cluster
    from orchestrator.devcluster.apiserver import CrdSource
    from orchestrator.devcluster.up import packaged_crds

    configure_logging(log_level)
    crds: list[CrdSource] = [*crd_files] if crd_files else [*packaged_crds()]
    try:
        run_dev_cluster(
            port,
            kubeconfig,
            crds,
            on_ready=lambda url: click.echo(
                f"Kubernetes API at {url}; kubectl --kubeconfig {kubeconfig} get ns"
            ),
        )
    except DevClusterError as exc:
        raise OperationFailed(str(exc)) from None


@dev.command("controller")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="The pods' volumes, snapshot copies and logs (kept across restarts).",
)
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="KUBECONFIG",
    required=True,
    help="The API's kubeconfig (default: $KUBECONFIG); waited for if not there yet.",
)
@click.option(
    "--wait",
    "wait_secs",
    type=click.FloatRange(min=0),
    default=300.0,
    show_default=True,
    help="Seconds to wait for the kubeconfig to appear and the API to answer.",
)
@log_level_option
def dev_controller(state_dir: Path, kubeconfig: Path, wait_secs: float, log_level: str) -> None:
    """Run the stand-in Sandbox controller and CSI driver against a running API (drainctl
    dev cluster), in the foreground, until SIGTERM or Ctrl-C: daemons as local processes."""
    configure_logging(log_level)
    from orchestrator.devcluster import DevClusterError
    from orchestrator.devcluster.attached import run_attached_controller

    try:
        asyncio.run(
            run_attached_controller(state_dir.resolve(), kubeconfig.resolve(), wait_secs=wait_secs)
        )
    except DevClusterError as exc:
        raise OperationFailed(str(exc)) from None
