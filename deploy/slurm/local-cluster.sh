#!/usr/bin/env bash
# A one-host Slurm cluster from Debian's packages, for trying the sbatch scripts and for tests.
#
#   deploy/slurm/local-cluster.sh          install (if missing), configure, start; idempotent
#   deploy/slurm/local-cluster.sh stop     stop slurmctld, slurmd and munged (if this started them)
#   deploy/slurm/local-cluster.sh status   exit 0 when the node takes jobs
#
# As root (it installs packages, writes /etc/slurm/slurm.conf and starts daemons). The node is
# this host, named as `hostname -s` says, with 4 job slots per core (SlurmdParameters=
# config_overrides), so a run and a second job of workers fit on a 2-core machine. Processes are
# tracked by their parentage (proctrack/linuxproc), which sees a process that starts a session
# of its own; needing no cgroups, it runs in containers too. KillWait=5: a job's processes get
# SIGKILL 5 s after scancel's SIGTERM. A slurm.conf that this script did not write is left alone
# (it says so and exits 1). Daemons log to /var/log/slurm/.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARK="# written by stepbus deploy/slurm/local-cluster.sh"
PACKAGES=(slurmctld slurmd slurm-client munge)

say() { echo "local-cluster: $*" >&2; }

need_root() {
    if [[ $(id -u) != 0 ]]; then
        say "needs root (it installs packages, writes $CONF and starts daemons)"
        exit 1
    fi
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
            && command -v sbatch >/dev/null && command -v munged >/dev/null; then
        return
    fi
    say "installing ${PACKAGES[*]} from Debian's packages"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y --no-install-recommends "${PACKAGES[@]}" >/tmp/stepbus-slurm-apt.log 2>&1; then
        apt-get update -qq >>/tmp/stepbus-slurm-apt.log 2>&1 || true
        if ! apt-get install -y --no-install-recommends "${PACKAGES[@]}" >>/tmp/stepbus-slurm-apt.log 2>&1; then
            say "cannot install ${PACKAGES[*]} (apt-get failed; /tmp/stepbus-slurm-apt.log):"
            tail -5 /tmp/stepbus-slurm-apt.log >&2
            exit 1
        fi
    fi
}

write_conf() {
    local host cpus
    host=$(hostname -s)
    cpus=$(( $(nproc) * 4 ))
    if [[ -f $CONF ]] && ! head -1 "$CONF" | grep -qF "$MARK"; then
        say "$CONF exists and was not written by this script; leaving it alone"
        exit 1
    fi
    mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/slurm
    cat >"$CONF.new" <<EOF
$MARK
ClusterName=stepbus-local
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=60
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    if [[ -f $CONF ]] && cmp -s "$CONF" "$CONF.new"; then
        rm "$CONF.new"
    else
        mv "$CONF.new" "$CONF"
        CONF_CHANGED=1
    fi
}

# The daemon of a pid file runs (its pid may have gone to another process since: compare names).
running() {
    local pid
    [[ -f $1 ]] || return 1
    pid=$(cat "$1")
    [[ -n $pid && $(cat "/proc/$pid/comm" 2>/dev/null) == "$(basename "$1" .pid)" ]]
}

start_munge() {
    if munge -n </dev/null >/dev/null 2>&1; then
        return
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        /usr/sbin/mungekey --create --keyfile /etc/munge/munge.key
        chown munge:munge /etc/munge/munge.key
        chmod 400 /etc/munge/munge.key
    fi
    runuser -u munge -- /usr/sbin/munged
}

start_slurm() {
    if [[ ${CONF_CHANGED:-0} == 1 ]]; then
        stop_slurm  # daemons started with another slurm.conf
    fi
    running /run/slurm/slurmctld.pid || slurmctld
    running /run/slurm/slurmd.pid || slurmd
    local deadline=$((SECONDS + 30))
    until node_ready; do
        if ((SECONDS > deadline)); then
            say "the node did not come up within 30 s:"
            sinfo -N -l >&2 || true
            tail -5 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
            exit 1
        fi
        sleep 0.2
    done
    # A node left down or drained by an earlier run of the daemons takes jobs again.
    scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true
}

node_ready() {
    local state
    state=$(sinfo -h -N -o %t 2>/dev/null | head -1) || return 1
    [[ $state == idle || $state == mix || $state == alloc ]]
}

stop_pidfile() {
    local pidfile=$1 pid
    running "$pidfile" || return 0
    pid=$(cat "$pidfile")
    kill "$pid"
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
}

stop_slurm() {
    stop_pidfile /run/slurm/slurmd.pid
    stop_pidfile /run/slurm/slurmctld.pid
}

case ${1:-start} in
    start)
        need_root
        install_packages
        write_conf
        start_munge
        start_slurm
        say "up: node $(hostname -s), $(sinfo -h -N -o '%c CPUs, %t') (sbatch, squeue, scancel ready)"
        ;;
    stop)
        need_root
        stop_slurm
        if [[ -f /run/munge/munged.pid ]]; then
            stop_pidfile /run/munge/munged.pid
        fi
        say "stopped"
        ;;
    status)
        node_ready
        ;;
    *)
        echo "usage: $0 [start|stop|status]" >&2
        exit 2
        ;;
esac
