#!/usr/bin/env bash
# The Docker engine the compose test needs, as Debian packages it, on this machine.
#
#   scripts/docker-engine.sh run -- CMD...   install what is missing (docker.io,
#       docker-compose, mmdebstrap), start dockerd if it is not running, run CMD, and
#       stop dockerd again if this script started it; exits with CMD's status
#   scripts/docker-engine.sh start|stop      the same halves, for a shell (stop stops
#       only an engine that start started: its pid is in $STATE)
#
# Idempotent: nothing is installed or started twice. dockerd runs without a bridge or
# iptables rules (every container of the stack uses the host's network), its log in
# /tmp/caliban-drain-dockerd.log.
set -euo pipefail

STATE=/tmp/caliban-drain-dockerd.pid
LOG=/tmp/caliban-drain-dockerd.log

say() { echo "docker-engine: $*" >&2; }

install_missing() {
    local missing=()
    command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
    command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
    command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
    if [ ${#missing[@]} -gt 0 ]; then
        say "installing ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

engine_up() { docker info >/dev/null 2>&1; }

start() {
    install_missing
    if engine_up; then
        say "engine already running"
        return 0
    fi
    say "starting dockerd (log: $LOG)"
    dockerd --bridge=none --iptables=false >"$LOG" 2>&1 &
    echo $! >"$STATE"
    for _ in $(seq 1 120); do
        engine_up && { say "engine up"; return 0; }
        kill -0 "$(cat "$STATE")" 2>/dev/null || break
        sleep 0.5
    done
    say "dockerd did not come up; its log:"
    tail -n 20 "$LOG" >&2
    rm -f "$STATE"
    return 1
}

stop() {
    [ -f "$STATE" ] || return 0
    local pid
    pid=$(cat "$STATE")
    rm -f "$STATE"
    if kill -0 "$pid" 2>/dev/null; then
        say "stopping dockerd (pid $pid)"
        kill -TERM "$pid"
        for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    run)
        shift
        [ "${1:-}" = "--" ] && shift
        [ $# -gt 0 ] || { say "run needs a command: run -- CMD..."; exit 2; }
        started_here=0
        [ -f "$STATE" ] || engine_up || started_here=1
        start
        status=0
        "$@" || status=$?
        [ "$started_here" = 1 ] && stop
        exit "$status"
        ;;
    *) say "usage: $0 start|stop|run -- CMD..."; exit 2 ;;
esac
