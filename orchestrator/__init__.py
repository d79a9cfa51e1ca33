"""The orchestrator side of caliban-drain, and ``drainctl``, its command line."""
