"""The CalibanTask operator: a functional core and the shell around it.

- ``crd``: the names on the wire, written once — the CalibanTask's group, version,
  plural and kind, the drain finalizer, labels and annotations, kopf's annotation
  prefix, the Sandbox API versions and plural. Constants only; imports nothing.
- ``lifecycle``: the pure decisions — spec parsing, the delete finalizer, idle pause,
  kubectl-driven pause and wake, waiting for the daemon (Running, restart recovery),
  the resume outcome, idempotency keys, Sandbox suspension, conditions. No I/O.
- ``kube``: the Kubernetes calls besides kopf's own (Sandboxes, PVCs, status writes).
- ``handlers``: the kopf handlers, the imperative shell that fetches, asks
  ``lifecycle`` and applies.

Imports the pipeline and the ledger; never the CLI or the embedded Kubernetes API
(``orchestrator.devcluster``), which may import ``crd``.
"""
