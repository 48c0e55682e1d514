#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for CI and local testing of the sbatch scripts.
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
  mkdir -p "$DIR"/{state,spool}
  local cpus mem
  cpus=$(slurmd -C | sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' | head -1)
  mem=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
  cat > "$CONF" <<CONF
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
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=localhost CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
}

start() {
  install
  start_munge
  write_conf
  export SLURM_CONF=$CONF
  [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null || slurmctld -c -i -f "$CONF"
  [ -f "$DIR/slurmd.pid" ] && kill -0 "$(cat "$DIR/slurmd.pid")" 2>/dev/null || slurmd -N localhost -f "$CONF"
  for _ in $(seq 1 60); do
    if scontrol ping >/dev/null 2>&1 && sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix)'; then
      log "up: $(sinfo -h -o '%P %D %t %c cpus')"
      log "export SLURM_CONF=$CONF"
      return 0
    fi
    sleep 1
  done
  log "slurm did not come up; logs in $DIR"
  tail -n 20 "$DIR"/slurmctld.log "$DIR"/slurmd.log >&2 || true
  return 1
}

stop() {
  for d in slurmd slurmctld; do
    if [ -f "$DIR/$d.pid" ]; then
      kill "$(cat "$DIR/$d.pid")" 2>/dev/null || true
      rm -f "$DIR/$d.pid"
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
