#!/usr/bin/env bash
# A two-node Slurm cluster on one host, from Debian's packages, for trying the sbatch scripts
# and for tests.
#
#   deploy/slurm/local-cluster.sh          install (if missing), configure, start; idempotent
#   deploy/slurm/local-cluster.sh stop     stop the daemons and the jobs' processes, remove the
#                                          namespaces, veths, bridge and host names it made
#   deploy/slurm/local-cluster.sh status   exit 0 when both nodes take jobs
#
# As root (it installs packages, writes /etc/slurm/slurm.conf, makes network namespaces and
# starts daemons). slurmctld runs on this host, on a bridge of its own (stepbus-br0,
# 10.211.77.1). Each node, node1 (10.211.77.11) and node2 (.12), is a slurmd in a network
# namespace of its own (stepbus-node1, stepbus-node2; a veth to the bridge) and a UTS namespace
# with the node's hostname; its spool dir, pid file and log are its own (slurm.conf's %n). munged
# runs once on the host: its unix socket is a path, which every namespace sees. The names
# resolve everywhere: in the namespaces through /etc/netns/NS/hosts (bind-mounted over
# /etc/hosts for the node's processes), on the host through lines added to /etc/hosts (taken
# out again by stop). Each node has 4 job slots per core (SlurmdParameters=config_overrides),
# so a run and a second job of workers fit on a 2-core machine. Processes are tracked by their
# parentage (proctrack/linuxproc), not by cgroups. KillWait=5: a job's processes get SIGKILL
# 5 s after scancel's SIGTERM. MinJobAge=4: slurmctld forgets a finished job after 4 s, so
# `sbatch --wait` asks every 2 s (with a longer MinJobAge it backs off to 32 s). A slurm.conf
# that this script did not write is left alone (it says so and exits 1). Daemons log to
# /var/log/slurm/.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARK="# written by stepbus deploy/slurm/local-cluster.sh"
HOSTS_MARK="# stepbus local-cluster"
PACKAGES=(slurmctld slurmd slurm-client munge)
NET=10.211.77
BRIDGE=stepbus-br0
NODES=(node1 node2)

say() { echo "local-cluster: $*" >&2; }

need_root() {
    if [[ $(id -u) != 0 ]]; then
        say "needs root (it installs packages, writes $CONF, makes namespaces, starts daemons)"
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

# node1 -> 10.211.77.11, node2 -> .12
address() { echo "$NET.$((10 + ${1#node}))"; }
node_list() { (IFS=,; echo "${NODES[*]}"); }

write_conf() {
    local host cpus
    host=$(hostname -s)
    cpus=$(( $(nproc) * 4 ))
    if [[ -f $CONF ]] && ! head -1 "$CONF" | grep -qF "$MARK"; then
        say "$CONF exists and was not written by this script; leaving it alone"
        exit 1
    fi
    mkdir -p /etc/slurm /var/spool/slurmctld /var/log/slurm /run/slurm
    for node in "${NODES[@]}"; do mkdir -p "/var/spool/slurmd/$node"; done
    cat >"$CONF.new" <<EOF
$MARK
ClusterName=stepbus-local
SlurmctldHost=$host($NET.1)
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
MinJobAge=4
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
$(for node in "${NODES[@]}"; do
    echo "NodeName=$node NodeAddr=$(address "$node") CPUs=$cpus State=UNKNOWN"
done)
PartitionName=local Nodes=$(node_list) Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    if [[ -f $CONF ]] && cmp -s "$CONF" "$CONF.new"; then
        rm "$CONF.new"
    else
        mv "$CONF.new" "$CONF"
        CONF_CHANGED=1
    fi
}

# The names of the host and the nodes, for /etc/hosts.
host_lines() {
    echo "$NET.1 $(hostname -s)"
    for node in "${NODES[@]}"; do echo "$(address "$node") $node"; done
}

# The bridge on the host, and per node a namespace with a veth to it and its /etc/hosts.
make_network() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
        ip addr add "$NET.1/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
    for node in "${NODES[@]}"; do
        local ns=stepbus-$node veth=sbv-$node
        [[ -e /run/netns/$ns ]] || ip netns add "$ns"
        if ! ip link show "$veth" >/dev/null 2>&1; then
            ip link add "$veth" type veth peer name eth0 netns "$ns"
            ip link set "$veth" master "$BRIDGE" up
            ip -n "$ns" addr add "$(address "$node")/24" dev eth0
        fi
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        mkdir -p "/etc/netns/$ns"
        { echo "127.0.0.1 localhost"; host_lines; } >"/etc/netns/$ns/hosts"
    done
    if ! grep -qF "$HOSTS_MARK" /etc/hosts; then
        host_lines | sed "s/\$/ $HOSTS_MARK/" >>/etc/hosts
    fi
}

remove_network() {
    local kept
    for node in "${NODES[@]}"; do
        ip netns del "stepbus-$node" 2>/dev/null || true
        ip link del "sbv-$node" 2>/dev/null || true
        rm -rf "/etc/netns/stepbus-$node"
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    if grep -qF "$HOSTS_MARK" /etc/hosts; then
        # Written in place: /etc/hosts may be a mount point, which a rename cannot replace.
        kept=$(grep -vF "$HOSTS_MARK" /etc/hosts)
        echo "$kept" >/etc/hosts
    fi
}

# The daemon of a pid file runs (its pid may have gone to another process since: compare names).
running() {
    local pidfile=$1 name=$2 pid
    [[ -f $pidfile ]] || return 1
    pid=$(cat "$pidfile")
    [[ -n $pid && $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]]
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
    running /run/slurm/slurmctld.pid slurmctld || slurmctld
    local since started=()
    since=$(date +%Y-%m-%dT%H:%M:%S)
    for node in "${NODES[@]}"; do
        running "/run/slurm/slurmd-$node.pid" slurmd && continue
        started+=("$node")
        # slurmd finds its NodeName by the hostname, set in the node's own UTS namespace; a
        # mount namespace puts the node's hosts file over /etc/hosts (`ip netns exec` would too,
        # but it mounts a /sys without the cgroup mounts slurmd needs).
        nsenter --net="/run/netns/stepbus-$node" unshare --uts --mount sh -c \
            "mount --bind /etc/netns/stepbus-$node/hosts /etc/hosts && hostname $node \
             && exec slurmd"
    done
    local deadline=$((SECONDS + 30))
    until nodes_ready && registered_since "$since" "${started[@]}"; do
        if ((SECONDS > deadline)); then
            say "the nodes did not come up within 30 s:"
            sinfo -N -l >&2 || true
            tail -5 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd-*.log >&2 || true
            exit 1
        fi
        sleep 0.2
    done
    # A node left down or drained by an earlier run of the daemons takes jobs again.
    scontrol update nodename="$(node_list)" state=resume >/dev/null 2>&1 || true
}

# The nodes' slurmd registered with slurmctld at or after a time (slurmctld's saved state may
# say a node is idle before its new slurmd is up).
registered_since() {
    local since=$1 node at
    shift
    for node; do
        at=$(scontrol show node "$node" 2>/dev/null | grep -o 'SlurmdStartTime=[0-9T:-]*') \
            || return 1
        [[ ! ${at#*=} < $since ]] || return 1
    done
}

# Every node takes jobs.
nodes_ready() {
    local states
    states=$(sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
    for node in "${NODES[@]}"; do
        grep -qE "^$node (idle|mix|alloc)\$" <<<"$states" || return 1
    done
}

stop_pidfile() {
    local pidfile=$1 name=$2 pid
    running "$pidfile" "$name" || return 0
    pid=$(cat "$pidfile")
    kill "$pid"
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
}

# The daemons stop at once (each takes 1-2 s).
stop_slurm() {
    local pidfile
    for pidfile in /run/slurm/slurmd*.pid; do
        [[ -e $pidfile ]] && stop_pidfile "$pidfile" slurmd &
    done
    stop_pidfile /run/slurm/slurmctld.pid slurmctld &
    wait
}

# scancel every job, so none is left running in slurmctld's saved state; their processes get
# SIGTERM as on any scancel (and SIGKILL KillWait later).
cancel_jobs() {
    local jobs
    running /run/slurm/slurmctld.pid slurmctld || return 0
    jobs=$(squeue -h -o %i 2>/dev/null) || return 0
    [[ -n $jobs ]] || return 0
    # shellcheck disable=SC2086  # one job id per word
    scancel $jobs || true
    for _ in $(seq 100); do
        [[ -z $(squeue -h -o %i 2>/dev/null) ]] && return 0
        sleep 0.1
    done
}

# Whatever still runs on a node (jobs' processes, slurmstepd) once its slurmd stopped.
stop_node_processes() {
    local node pids
    for node in "${NODES[@]}"; do
        [[ -e /run/netns/stepbus-$node ]] || continue
        pids=$(ip netns pids "stepbus-$node")
        [[ -z $pids ]] && continue
        # shellcheck disable=SC2086  # one pid per word
        kill -TERM $pids 2>/dev/null || true
        for _ in $(seq 50); do
            [[ -z $(ip netns pids "stepbus-$node") ]] && break
            sleep 0.1
        done
        pids=$(ip netns pids "stepbus-$node")
        # shellcheck disable=SC2086
        [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
    done
}

case ${1:-start} in
    start)
        need_root
        install_packages
        write_conf
        make_network
        start_munge
        start_slurm
        say "up: $(sinfo -h -N -o '%N (%c CPUs, %t)' | paste -sd ' ') on bridge $BRIDGE," \
            "controller $(hostname -s) ($NET.1); sbatch, squeue, scancel ready"
        ;;
    stop)
        need_root
        cancel_jobs
        stop_slurm
        stop_node_processes
        remove_network
        if [[ -f /run/munge/munged.pid ]]; then
            stop_pidfile /run/munge/munged.pid munged
        fi
        say "stopped"
        ;;
    status)
        nodes_ready
        ;;
    *)
        echo "usage: $0 [start|stop|status]" >&2
        exit 2
        ;;
esac
