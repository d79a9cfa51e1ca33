"""``python -m orchestrator.cli``: the same as ``drainctl``."""

from orchestrator.cli import main

main()
