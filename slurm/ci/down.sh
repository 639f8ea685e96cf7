#!/usr/bin/env bash
# Stop the Slurm that slurm/ci/up.sh started from STATE_DIR (default /tmp/tpkit-slurm):
# slurmd, slurmctld, and munged if up.sh started it. Safe to run twice.
set -uo pipefail
state=$(realpath -m "${1:-/tmp/tpkit-slurm}")
stop() {  # stop PIDFILE: TERM, wait up to 5 s, then KILL
    local pid
    [ -s "$1" ] || return 0
    pid=$(cat "$1")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$1"
}
stop "$state/slurmd.pid"
stop "$state/slurmctld.pid"
if [ -s "$state/munged.ours" ]; then
    stop "$(cat "$state/munged.ours")"
    rm -f "$state/munged.ours"
fi
exit 0
