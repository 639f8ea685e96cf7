#!/usr/bin/env bash
# Stop the Slurm that slurm/ci/up.sh started from STATE_DIR (default: the directory of
# $SLURM_CONF): slurmd, slurmctld, and munged if up.sh started it. Safe to run twice.
# The cluster is throw-away (up.sh starts slurmctld with -c), so daemons get SIGTERM and,
# if still alive after 2 s (slurmctld can take ~5 s saving state), SIGKILL. Only a
# private STATE_DIR (owned by the caller, mode 0700) is trusted, and only processes that
# are those daemons are signalled.
set -uo pipefail
log() { echo "[slurm/ci/down.sh] $*" >&2; }
arg=${1:-${SLURM_CONF:+$(dirname "$SLURM_CONF")}}
[ -n "$arg" ] || { log "pass the STATE_DIR up.sh printed (or set SLURM_CONF)"; exit 2; }
state=$(realpath -m "$arg")
[ -d "$state" ] || exit 0
if [ -L "$arg" ] || [ "$(stat -c %u "$state")" != "$(id -u)" ] \
        || [ "$(stat -c %a "$state")" != 700 ]; then
    log "refusing STATE_DIR $state: not a private directory of $(id -un) (mode 0700)"
    exit 1
fi
pidfiles=("$state/slurmd.pid" "$state/slurmctld.pid")
[ -s "$state/munged.ours" ] && pidfiles+=("$(cat "$state/munged.ours")")
pids=()
for f in "${pidfiles[@]}"; do
    [ -s "$f" ] && pid=$(cat "$f") && [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null \
        && [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" =~ ^(slurmd|slurmctld|munged)$ ]] \
        && pids+=("$pid")
done
[ "${#pids[@]}" -gt 0 ] && kill -TERM "${pids[@]}" 2>/dev/null
for _ in $(seq 20); do
    alive=()
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
    [ "${#alive[@]}" -eq 0 ] && break
    sleep 0.1
done
for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
rm -f "$state/slurmd.pid" "$state/slurmctld.pid" "$state/munged.ours"
exit 0
