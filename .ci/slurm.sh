#!/usr/bin/env bash
# A throw-away single-node Slurm (Debian 12 packages, Slurm 22.05 + munge) for CI and development,
# so that tests/test_slurm.py can submit the real launchers/slurm/nvl72.sbatch.
#
#   bash .ci/slurm.sh up     # install if needed, start munged + slurmctld + slurmd, wait until the node is idle
#   bash .ci/slurm.sh down   # stop slurmd, slurmctld, munged (started by `up`)
#
# Needs root (it installs packages and writes /etc/slurm/slurm.conf). It refuses to overwrite a
# slurm.conf that it did not write, so it never clobbers a real cluster's configuration.
# Oversubscription: the node is declared with max(nproc, 4) CPUs (SlurmdParameters=config_overrides
# keeps it from being drained for having fewer), so 2 tasks x 2 simulated JAX devices -- and even the
# GB200 default of 4 tasks per node -- are schedulable on a 1- or 2-core box. The JAX "devices" are
# XLA_FLAGS=--xla_force_host_platform_device_count threads, not Slurm CPUs.
# MinJobAge=4: `sbatch --wait` polls every 2 s only while that is below MinJobAge/2 (else it sleeps 2, 8, 32 s:
# +17 s for a 25 s job); finished jobs still stay visible to scontrol until the next purge (~1 min).
set -euo pipefail

STATE=${MAXOFFLOAD_SLURM_STATE:-/var/tmp/maxoffload-slurm}   # spool, state, logs, pid files
CONF=/etc/slurm/slurm.conf
MARK="# written by MaxOffload .ci/slurm.sh"
HOST=$(hostname -s)
PACKAGES=(slurmctld slurmd slurm-client munge)

log() { echo "[slurm.sh] $*" >&2; }

diagnose() {
    log "diagnostics:"
    sinfo -N -l 2>&1 | sed 's/^/  sinfo: /' >&2 || true
    scontrol show node "$HOST" 2>&1 | sed 's/^/  node: /' >&2 || true
    for f in "$STATE"/slurmctld.log "$STATE"/slurmd.log /var/log/munge/munged.log; do
        [ -f "$f" ] && { log "--- tail $f"; tail -n 30 "$f" >&2; }
    done
    return 0
}

installed() { dpkg-query -W -f='${Status}\n' "$@" 2>/dev/null | grep -c "install ok installed" | grep -qx "$#"; }

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

up() {
    [ "$(id -u)" = 0 ] || { log "needs root"; exit 1; }
    if installed "${PACKAGES[@]}"; then
        log "packages already installed"
    else
        log "installing ${PACKAGES[*]} ..."
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
    fi

    # munge: key, ownership, daemon as user munge
    mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
    if [ ! -s /etc/munge/munge.key ]; then
        log "creating /etc/munge/munge.key"
        mungekey -c -k /etc/munge/munge.key
    fi
    chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
    chmod 700 /etc/munge && chmod 600 /etc/munge/munge.key && chmod 755 /run/munge
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        log "munged already running"
    else
        runuser -u munge -- munged
    fi

    # slurm.conf
    if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        log "$CONF exists and was not written by this script; refusing to overwrite it"
        exit 1
    fi
    mkdir -p "$STATE/ctld" "$STATE/d" /etc/slurm
    local cpus mem
    cpus=$(nproc); [ "$cpus" -ge 4 ] || cpus=4
    mem=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
    cat > "$CONF" <<EOF
$MARK (single-node CI cluster; see REFERENCE.md section 8)
ClusterName=local
SlurmctldHost=$HOST
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmUser=root
SlurmdUser=root
SlurmdParameters=config_overrides
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
ReturnToService=2
JobRequeue=1
MinJobAge=4
MailProg=/bin/true
KillWait=5
InactiveLimit=0
NodeName=$HOST CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF

    if pid_alive "$STATE/slurmctld.pid" && pid_alive "$STATE/slurmd.pid"; then
        log "slurmctld and slurmd already running; re-reading $CONF"
        scontrol reconfigure || { diagnose; exit 1; }
    else
        pid_alive "$STATE/slurmctld.pid" || slurmctld -c
        pid_alive "$STATE/slurmd.pid" || slurmd
    fi

    local state=""
    for _ in $(seq 60); do
        state=$(sinfo -h -n "$HOST" -o %t 2>/dev/null || true)
        case "$state" in
            idle|mix|alloc) log "node $HOST is $state"; sinfo >&2; return 0 ;;
            down*|drain*|drng*) scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
        esac
        sleep 1
    done
    log "node $HOST not idle after 60 s (state: '${state:-unknown}')"
    diagnose
    exit 1
}

stop_daemon() {  # name pidfile
    local pid
    if [ -f "$2" ] && pid=$(cat "$2") && kill -0 "$pid" 2>/dev/null; then
        kill "$pid" && for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        log "stopped $1"
    fi
    rm -f "$2"
}

down() {
    stop_daemon slurmd "$STATE/slurmd.pid"
    stop_daemon slurmctld "$STATE/slurmctld.pid"
    stop_daemon munged /run/munge/munged.pid
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    *) echo "usage: bash .ci/slurm.sh up|down" >&2; exit 2 ;;
esac
