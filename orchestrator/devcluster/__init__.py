"""Kubernetes for development and tests, on one machine, with nothing installed.

- ``apiserver``: :class:`EmbeddedApiServer` and ``drainctl dev cluster``
  (:func:`run_dev_cluster`): an in-process Kubernetes API that kubectl and kopf accept.
- ``emulator``: kmock's Kubernetes emulator extended with what they rely on (parsing,
  Tables, watches); ``store``: the API server's rules (metadata, finalizers, garbage
  collection, status subresource, watch log); ``persistence``: those objects in a file
that outlives the process (``drainctl dev up``'s state dir); ``resources``: what is served;
  ``discovery``, ``schema``, ``cel`` (CRD validation rules), ``patching``,
  ``managed_fields`` (field managers and server-side apply), ``selectors``, ``tables``,
  ``protobuf``: the pure parts; ``errors``: the ``Status`` failures; ``kubeconfig``: the
  file clients read.
- ``sandbox_controller``: a local stand-in for the agent-sandbox controller, and ``csi``
  the stand-in CSI driver and snapshotter it runs (PVCs, VolumeSnapshots and restores as
  directories: :data:`DEV_CSI_DRIVER`, the class :data:`DEV_SNAPSHOT_CLASS`); ``up``:
  ``drainctl dev up``, the whole stack around this API, serving the CRDs shipped as
  package data (``orchestrator/operator/crds/``, agent-sandbox's own Sandbox CRD in
  ``crds/agent-sandbox/`` here, and the external-snapshotter's CRDs in ``crds/snapshots/``
  unless ``--no-snapshots``); ``conversion``: the built-in converters standing in for
  conversion webhooks (agent-sandbox's, between the Sandbox's v1alpha1 and v1beta1).

Installed with the ``dev`` extra (``pip install 'caliban-drain[dev]'``: kmock, aiohttp,
jsonpatch, jsonpointer, attrs, cel-python, PyYAML); no runtime process needs it. It may import the
ledger (``drainctl dev up`` migrates it) and ``worker_agent``; only the CLI, the demo
and the testing kit may import it, so the operator, the worker and the daemon never load
it. ``tests/unit/test_import_rules.py`` enforces both.
"""

from orchestrator.devcluster.apiserver import (
    DevClusterError,
    EmbeddedApiServer,
    load_crds,
    run_dev_cluster,
    serve_dev_cluster,
)
from orchestrator.devcluster.csi import DEV_CSI_DRIVER, DEV_SNAPSHOT_CLASS
from orchestrator.devcluster.kubeconfig import write_kubeconfig

__all__ = [
    "DEV_CSI_DRIVER",
    "DEV_SNAPSHOT_CLASS",
    "DevClusterError",
    "EmbeddedApiServer",
    "load_crds",
    "run_dev_cluster",
    "serve_dev_cluster",
    "write_kubeconfig",
]
