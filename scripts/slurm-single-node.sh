#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for notebook 12 and its tests (Debian/Ubuntu, root):
# installs slurm-wlm and munge if missing, writes a minimal slurm.conf (this host, partition
# "debug", 8 CPUs whatever the machine has, so 4 engines and a launcher fit on 2 cores), starts
# munged, slurmctld and slurmd, and waits until `sinfo` shows the node idle. Safe to run again.
# Stop it with: scripts/slurm-single-node.sh stop
set -euo pipefail
if [ "$(id -u)" != 0 ]; then echo "run as root (it installs packages and starts daemons)" >&2; exit 1; fi
if [ "${1:-}" = stop ]; then
    pkill -x slurmd || true; pkill -x slurmctld || true; pkill -x munged || true
    exit 0
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
host=$(hostname -s)
mkdir -p /etc/slurm /var/spool/slurmd /var/spool/slurmctld /var/log/slurm /run/munge
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=course
SlurmctldHost=$host
AuthType=auth/munge
SlurmUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/spool/slurmd
StateSaveLocation=/var/spool/slurmctld
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host CPUs=8 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
[ -s /etc/munge/munge.key ] || mungekey --create 2>/dev/null || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
# A daemon must not keep what its caller had open (a CI log's pipe, a lock of the caller's held
# for hours): each starts with stdin, stdout and stderr on /dev/null and every other fd closed.
start_daemon() {
    (
        for fd in /proc/$BASHPID/fd/*; do
            fd=${fd##*/}
            if [ "$fd" -gt 2 ]; then eval "exec $fd>&-" 2>/dev/null || true; fi
        done
        exec setsid "$@" </dev/null >/dev/null 2>&1
    )
}
pgrep -x munged >/dev/null || start_daemon runuser -u munge -- munged
pgrep -x slurmctld >/dev/null || start_daemon slurmctld
pgrep -x slurmd >/dev/null || start_daemon slurmd
for _ in $(seq 60); do
    if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
        sinfo; exit 0
    fi
    scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
    sleep 1
done
echo "SLURM did not come up within 60 s; see /var/log/slurm/" >&2
sinfo >&2 || true
exit 1
