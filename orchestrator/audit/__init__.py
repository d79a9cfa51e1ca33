"""The self-audit: every claim of the status and the ledger checked against reality.

``findings`` names what can be found, ``checks`` judges (pure), ``observe`` reads the
cluster and the workspaces, ``runner`` runs one audit (and the periodic share of the
checkpoints), ``loud`` announces findings (events, ``Consistent`` condition, metrics,
logs) and ``periodic`` repeats the audit (``drainctl audit --every``). Nothing here
repairs or deletes anything; ``docs/audit.md`` gives the runbook for each finding.
"""

from orchestrator.audit.findings import Finding, FindingKind
from orchestrator.audit.runner import Auditor, AuditReport

__all__ = ["AuditReport", "Auditor", "Finding", "FindingKind"]
