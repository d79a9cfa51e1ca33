"""The daemon side of caliban-drain: what runs in a Sandbox pod.

``proto`` (wire types) · ``session`` (the resumable conversation file) · ``store``
(on-disk layout) · ``registry`` (live state) · ``process`` (worker processes) ·
``supervisor`` (what each verb does) · ``server`` (the accept loop) · ``client``
(blocking client) · ``worker`` and ``providers`` (the reference agent worker) ·
``consumer``, ``consumer_process`` and ``journal`` (the daemon-side Celery consumer,
kept as a child of ``drainctl daemon``, and what each operation already did) ·
``children`` (restarted child processes) · ``reaper`` (a command whose whole process
tree goes with it: how the dev stack runs a Sandbox pod) · ``settings`` (the daemon's ``DRAIN_…``
settings).

Must never import ``orchestrator``: the orchestrator imports this package (the
contract between the halves and the client), never the other way round. The pod installs
neither kopf, Flower, kmock nor SQLAlchemy, so nothing here may need them.
``tests/unit/test_import_rules.py`` enforces both (docs/architecture.md).
"""
