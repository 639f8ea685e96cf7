#!/usr/bin/env bash
# Start a throw-away single-node Slurm (munge + slurmctld + slurmd) without systemd, for
# CI and tests. Installs the Debian packages if they are missing. Needs root.
#
#   slurm/ci/up.sh [STATE_DIR]     # default: a new private directory (mktemp -d)
#   export SLURM_CONF=STATE_DIR/slurm.conf   # what the last line of output says
#   slurm/ci/down.sh STATE_DIR     # stops what up.sh started
#
# The config lives in STATE_DIR (not /etc/slurm) and uses free ports, so it never clobbers
# a system Slurm; clients find it through SLURM_CONF, which sbatch passes on to jobs.
# STATE_DIR holds the config root's daemons read and the pid files down.sh kills: it must
# be private. A given STATE_DIR that exists must be a directory (not a link) owned by the
# caller with mode 0700 (what mktemp -d makes); one that does not exist is created so.
set -euo pipefail
log() { echo "[slurm/ci/up.sh] $*" >&2; }
[ "$(id -u)" = 0 ] || { log "needs root (it starts munged, slurmctld and slurmd)"; exit 1; }
if [ $# -ge 1 ]; then
    if [ -e "$1" ] || [ -L "$1" ]; then
        if [ -L "$1" ] || [ ! -d "$1" ] || [ "$(stat -c %u "$1")" != "$(id -u)" ] \
                || [ "$(stat -c %a "$1")" != 700 ]; then
            log "refusing STATE_DIR $1: it must be a directory owned by $(id -un) with mode" \
                "0700, not a link (e.g. made by mktemp -d), or not exist yet"
            exit 1
        fi
    else
        mkdir -p "$(dirname "$1")"
        mkdir -m 0700 "$1"     # fails if someone created it meanwhile
    fi
    state=$(realpath "$1")
else
    state=$(mktemp -d "${TMPDIR:-/tmp}/tpkit-slurm.XXXXXX")
fi
log "state directory: $state (stop with slurm/ci/down.sh $state)"

missing=0
for bin in slurmctld slurmd sbatch scontrol munged munge; do
    command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || missing=1
done
if [ "$missing" = 1 ]; then
    log "installing slurmctld slurmd slurm-client munge (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >&2
fi
export PATH="/usr/sbin:/sbin:$PATH"

if [ -s "$state/slurmctld.pid" ] && kill -0 "$(cat "$state/slurmctld.pid")" 2>/dev/null; then
    log "a Slurm from $state is still running; stopping it first"
    "$(dirname "$0")/down.sh" "$state"
fi
mkdir -p "$state/ctld" "$state/d"

# --- munge: reuse a running munged, otherwise start one (and remember that we did) ---
if ! (munge -n | unmunge) >/dev/null 2>&1; then
    install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
    install -d -o munge -g munge -m 0755 /run/munge
    if [ ! -s /etc/munge/munge.key ]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged
    echo /run/munge/munged.pid > "$state/munged.ours"
    for _ in $(seq 100); do (munge -n | unmunge) >/dev/null 2>&1 && break; sleep 0.1; done
    (munge -n | unmunge) >/dev/null 2>&1 || { log "munged did not come up"; exit 1; }
fi

# --- config: free ports, a node that advertises at least 4 CPUs (config_overrides) ---
read -r ctld_port d_port < <(python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
PY
)
cpus=$(nproc); [ "$cpus" -ge 4 ] || cpus=4
# MinJobAge=4: `sbatch --wait` multiplies its 2 s poll interval by 4 (up to 32 s) while it
# is below MinJobAge/2 (Slurm 22.05), so the default 300 makes a 12 s job wait 42 s.
# With 4 it polls every 2 s; a finished job stays visible for 4 s, enough for that poll.
cat > "$state/slurm.conf" <<CONF
ClusterName=tpkit
SlurmctldHost=localhost
SlurmctldPort=$ctld_port
SlurmdPort=$d_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=4
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=1024 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF="$state/slurm.conf"

slurmctld -c -i -f "$SLURM_CONF"
slurmd -N localhost -f "$SLURM_CONF"
for i in $(seq 300); do
    st=$(sinfo -h -N -o %T 2>/dev/null | head -n1 || true)
    case "$st" in
        idle*) break ;;
        down*|drain*) scontrol update NodeName=localhost State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.1
done
[ "${st:-}" = idle ] || { log "node did not become idle (state '${st:-none}'); see $state/*.log"; exit 1; }
log "Slurm is up: $(sinfo -h -o '%P %D %C %T')"
echo "export SLURM_CONF=$SLURM_CONF"
