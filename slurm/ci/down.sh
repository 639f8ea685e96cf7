#!/usr/bin/env bash
# Stop the Slurm that slurm/ci/up.sh started from STATE_DIR (default /tmp/tpkit-slurm):
# slurmd, slurmctld, and munged if up.sh started it. Safe to run twice.
# The cluster is throw-away (up.sh starts slurmctld with -c), so daemons get SIGTERM and,
# if still alive after 2 s (slurmctld can take ~5 s saving state), SIGKILL.
set -uo pipefail
state=$(realpath -m "${1:-/tmp/tpkit-slurm}")
pidfiles=("$state/slurmd.pid" "$state/slurmctld.pid")
[ -s "$state/munged.ours" ] && pidfiles+=("$(cat "$state/munged.ours")")
pids=()
for f in "${pidfiles[@]}"; do
    [ -s "$f" ] && pid=$(cat "$f") && kill -0 "$pid" 2>/dev/null && pids+=("$pid")
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
