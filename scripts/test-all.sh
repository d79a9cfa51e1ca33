#!/usr/bin/env bash
# `make test`: lint and types, the suite, the compose test, then the quick benchmarks.
#
# The compose test's Docker engine and images are made ready while the suite runs:
# installing Debian's packages, mmdebstrap and the image builds wait on the network and
# the disk far more than they use a core (about 5 minutes of waiting, 1 of CPU, on a
# fresh machine), so the suite hides them. A failure there fails nothing by itself:
# `make compose-test` builds what is missing and says what went wrong. The engine
# started here is stopped before the benchmarks, and on any exit.
set -euo pipefail
cd "$(dirname "$0")/.."
MAKE=${MAKE:-make}
PY=${PY:-.venv/bin/python}
LOG=/tmp/caliban-drain-compose-prepare.log

$MAKE check

setsid -w bash -c "bash scripts/docker-engine.sh start && $PY -m tests.compose.images" \
    >"$LOG" 2>&1 &
prepare=$!
stop_prepare() {
    kill -TERM -- "-$prepare" 2>/dev/null || true
    wait "$prepare" 2>/dev/null || true
    bash scripts/docker-engine.sh stop
}
trap stop_prepare EXIT

$MAKE pytest
if wait "$prepare"; then
    echo "test-all: compose images ready while the suite ran ($(tail -n 1 "$LOG"))"
else
    echo "test-all: preparing the compose test failed (log: $LOG); compose-test retries" >&2
fi
$MAKE compose-test
bash scripts/docker-engine.sh stop
$MAKE bench-test
