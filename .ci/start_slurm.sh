#!/usr/bin/env bash
# Start a real single-node Slurm cluster for CI: munge, MariaDB + slurmdbd (accounting), slurmctld, slurmd, with
# fake GPUs declared through gres. Debian 12, root, no systemd. Leaves the daemons running and returns 0 once
# `sinfo` shows the node idle and the cluster is registered in slurmdbd; stop them with .ci/stop_slurm.sh.
#
# Knobs (environment):
#   SLURM_TEST_DIR  scratch folder for logs, PID list and fake GPU device nodes (default /tmp/mokbench-slurm);
#                   must be on a filesystem mounted without `nodev` (the fake GPUs are character devices)
#   FAKE_GPUS       gres GPUs the node declares (default 2; 0 = none)
#
# Re-runs are safe: daemons named in our PID files are stopped first, and the controller state and the
# accounting database are recreated (old state or old sacct rows would collide with new job ids).
# Follows /work/shared/notes/local-slurm.md (the tested recipe); packages are installed only when missing.
set -euo pipefail

SLURM_TEST_DIR=${SLURM_TEST_DIR:-/tmp/mokbench-slurm}
FAKE_GPUS=${FAKE_GPUS:-2}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export SLURM_TEST_DIR
mkdir -p "$SLURM_TEST_DIR"
T0=$(date +%s)
log() { echo "[start_slurm +$(($(date +%s) - T0))s] $*"; }

[ "$(id -u)" = 0 ] || { echo "start_slurm.sh needs root" >&2; exit 1; }

wait_for() { # wait_for DESC SECONDS CMD...
  local desc=$1 secs=$2 i
  shift 2
  for ((i = 0; i < secs * 5; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  echo "timed out waiting for $desc" >&2
  return 1
}

dump_logs() {
  local f
  for f in /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log /var/log/slurm/slurmdbd.log \
    "$SLURM_TEST_DIR/mariadb.log" "$SLURM_TEST_DIR/apt.log"; do
    [ -f "$f" ] && { echo "==== $f"; tail -n 30 "$f"; }
  done
  return 0
}

on_exit() {
  local rc=$?
  if [ $rc -ne 0 ]; then
    log "FAILED (rc=$rc); daemon logs follow, then the daemons started so far are stopped"
    dump_logs
    bash "$HERE/stop_slurm.sh" || true
  fi
}
trap on_exit EXIT

# 1. packages (the postinst scripts' service starts are refused without systemd: harmless)
PKGS="munge slurm-client slurmctld slurmd slurmdbd mariadb-server"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  log "apt-get install$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >"$SLURM_TEST_DIR/apt.log" 2>&1
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $missing >>"$SLURM_TEST_DIR/apt.log" 2>&1
else
  log "packages already installed"
fi

# A previous start may have left daemons running: stop them (by PID) before starting fresh ones.
bash "$HERE/stop_slurm.sh" --quiet
PIDLIST=$SLURM_TEST_DIR/daemons.pid # "name pidfile" lines, read by stop_slurm.sh
: >"$PIDLIST"
record() { echo "$1 $2" >>"$PIDLIST"; }

# 2. munge
log "munge"
[ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
runuser -u munge -- /usr/sbin/munged
record munged /run/munge/munged.pid
wait_for munged 10 bash -c 'munge -n | unmunge'

# 3. MariaDB and a fresh accounting database
log "mariadb"
install -d -o mysql -g mysql -m 0755 /run/mysqld
if [ ! -d /var/lib/mysql/mysql ]; then
  mariadb-install-db --user=mysql --datadir=/var/lib/mysql >>"$SLURM_TEST_DIR/mariadb.log" 2>&1
fi
setsid nohup /usr/sbin/mariadbd --user=mysql --bind-address=127.0.0.1 --pid-file=/run/mysqld/mysqld.pid \
  >"$SLURM_TEST_DIR/mariadb.log" 2>&1 </dev/null &
record mariadbd /run/mysqld/mysqld.pid
wait_for mariadb 60 mysqladmin ping
mysql -e "DROP DATABASE IF EXISTS slurm_acct_db; CREATE DATABASE slurm_acct_db;
          CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmpw';
          GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"

# 4. configuration
log "config (FAKE_GPUS=$FAKE_GPUS)"
HOST=$(hostname -s)
# Ranks find their master by the node's name (harness/measure/dist.py); the node is pinned to 127.0.0.1 below.
getent hosts "$HOST" >/dev/null || { echo "127.0.0.1 $HOST" >>/etc/hosts; log "added $HOST to /etc/hosts"; }
NCPU=$(nproc)
MEM_MB=$(($(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) - 1024))
GRES_NODE=""
GRES_TYPES=""
if [ "$FAKE_GPUS" -gt 0 ]; then
  mkdir -p "$SLURM_TEST_DIR/fakedev"
  for ((g = 0; g < FAKE_GPUS; g++)); do
    # gres File= must be a character or block device (a plain file is rejected): reuse /dev/null's numbers
    dev=$SLURM_TEST_DIR/fakedev/gpu$g
    [ -c "$dev" ] || { rm -f "$dev"; mknod "$dev" c 1 3; }
  done
  echo "Name=gpu File=$SLURM_TEST_DIR/fakedev/gpu[0-$((FAKE_GPUS - 1))]" >/etc/slurm/gres.conf
  GRES_NODE="Gres=gpu:$FAKE_GPUS"
  GRES_TYPES="GresTypes=gpu"
else
  rm -f /etc/slurm/gres.conf
fi

cat >/etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=slurm
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=slurmpw
EOF
chown slurm:slurm /etc/slurm/slurmdbd.conf
chmod 0600 /etc/slurm/slurmdbd.conf

cat >/etc/slurm/slurm.conf <<EOF
# Written by mokbench .ci/start_slurm.sh: a single-node test cluster.
ClusterName=mokbenchci
SlurmctldHost=$HOST(127.0.0.1)
AuthType=auth/munge
CredType=cred/munge
SlurmUser=slurm
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
AccountingStorageTRES=gres/gpu
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
$GRES_TYPES
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
Waittime=0
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$NCPU RealMemory=$MEM_MB $GRES_NODE State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

# 5. Slurm daemons, with fresh controller state
log "slurmdbd / slurmctld / slurmd"
install -d -o slurm -g slurm /var/lib/slurm/slurmctld /var/log/slurm
install -d /var/lib/slurm/slurmd
rm -rf /var/lib/slurm/slurmctld/* /var/lib/slurm/slurmd/*
/usr/sbin/slurmdbd
record slurmdbd /run/slurmdbd.pid
wait_for slurmdbd 60 bash -c '</dev/tcp/127.0.0.1/6819'
/usr/sbin/slurmctld
record slurmctld /run/slurmctld.pid
wait_for slurmctld 60 scontrol ping
/usr/sbin/slurmd
record slurmd /run/slurmd.pid
wait_for "node idle" 60 bash -c '[ "$(sinfo -h -o %t)" = idle ]'
wait_for "cluster in slurmdbd" 30 bash -c 'sacctmgr -n -P list cluster format=cluster | grep -qx mokbenchci'

# 6. smoke check: one 2-task step
srun -n2 -t 1 hostname >/dev/null
sinfo
log "slurm is up (PIDs in $PIDLIST; stop with: bash .ci/stop_slurm.sh)"
