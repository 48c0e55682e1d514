#!/usr/bin/env bash
# A real Slurm cluster on this machine, for CI and local testing of the sbatch scripts: one
# slurmctld and one slurmd per node name (node1, node2 by default: SLURM_LOCAL_NODES), every node on
# this host (its own port and spool), so a job can span two "nodes" and lose one of them.
#
#   scripts/slurm/local_cluster.sh start    # install (Debian packages) if needed, start munge + slurm
#   scripts/slurm/local_cluster.sh status
#   scripts/slurm/local_cluster.sh stop
#
# Needs root (it writes /etc/munge and runs the daemons). State, logs and pid files live under
# $SLURM_LOCAL_DIR (default /tmp/megatron-ext-slurm). There is no systemd here: daemons are started
# directly and stopped by pid file.
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/megatron-ext-slurm}
CONF=$DIR/slurm.conf
NODES=${SLURM_LOCAL_NODES:-2}

log() { echo "[local_cluster] $*"; }

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null; then
    return
  fi
  log "installing slurmctld slurmd slurm-client munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null
}

start_munge() {
  mkdir -p /run/munge /etc/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  chmod 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  if ! pgrep -x munged >/dev/null; then
    runuser -u munge -- munged
  fi
}

write_conf() {
  mkdir -p "$DIR"/state
  local cpus mem names n
  cpus=$(slurmd -C | sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' | head -1)
  # The nodes share this host's memory: each declares its share.
  mem=$(awk -v n="$NODES" '/MemTotal/ {printf "%d", $2 / 1024 * 0.9 / n}' /proc/meminfo)
  names=$(seq -s, -f 'node%g' 1 "$NODES")
  {
    cat <<CONF
ClusterName=megatron-ext-local
SlurmctldHost=localhost
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.%n.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
CONF
    for n in $(seq 1 "$NODES"); do
      mkdir -p "$DIR/spool/node$n"
      echo "NodeName=node$n NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$((17000 + n)) CPUs=$cpus RealMemory=$mem State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=$names Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
  } > "$CONF"
}

start() {
  install
  start_munge
  write_conf
  export SLURM_CONF=$CONF
  [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null || slurmctld -c -i -f "$CONF"
  for n in $(seq 1 "$NODES"); do
    [ -f "$DIR/slurmd.node$n.pid" ] && kill -0 "$(cat "$DIR/slurmd.node$n.pid")" 2>/dev/null \
      || slurmd -N "node$n" -f "$CONF"
  done
  for _ in $(seq 1 60); do
    if scontrol ping >/dev/null 2>&1 && [ "$(sinfo -h -N -o %t 2>/dev/null | grep -cE '^(idle|mix)')" -ge "$NODES" ]; then
      log "up: $(sinfo -h -o '%P %D %t %c cpus')"
      log "export SLURM_CONF=$CONF"
      return 0
    fi
    sleep 1
  done
  log "slurm did not come up; logs in $DIR"
  tail -n 20 "$DIR"/slurmctld.log "$DIR"/slurmd.*.log >&2 || true
  return 1
}

stop() {
  for f in "$DIR"/slurmd.*.pid "$DIR"/slurmctld.pid; do
    if [ -f "$f" ]; then
      kill "$(cat "$f")" 2>/dev/null || true
      rm -f "$f"
    fi
  done
  log "stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) SLURM_CONF=$CONF scontrol ping && SLURM_CONF=$CONF sinfo ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
