"""``drainctl demo``: the whole story (``story``: a CalibanTask through create, idle pause,
wake, delete and restore on the dev stack) and, behind ``--daemon-only``, the daemon's
half alone (``daemon``: drain, SIGKILL, restart and resume of one daemon)."""
