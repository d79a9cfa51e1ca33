"""The CalibanTask operator.

``crd`` (the one place the CRD's group, versions, plural, finalizer, labels and
annotations are written), ``lifecycle`` (pure decisions: spec parsing, phase
transitions, idle and timeout rules; no I/O), ``kube`` (the Kubernetes calls) and
``handlers`` (kopf handlers: the imperative shell that fetches, asks ``lifecycle`` and
applies).

Imports the pipeline and the ledger; never the CLI or the embedded Kubernetes API.
"""
