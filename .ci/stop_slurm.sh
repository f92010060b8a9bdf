#!/usr/bin/env bash
# Stop the daemons .ci/start_slurm.sh started, newest first, each by its PID (read from its own PID file) and only
# if the process name still matches. Cancels this test cluster's jobs first so no job step outlives slurmd.
# Knob: SLURM_TEST_DIR (default /tmp/mokbench-slurm), as for start_slurm.sh.  --quiet: no summary line.
set -uo pipefail

SLURM_TEST_DIR=${SLURM_TEST_DIR:-/tmp/mokbench-slurm}
PIDLIST=$SLURM_TEST_DIR/daemons.pid
QUIET=0
[ "${1:-}" = --quiet ] && QUIET=1

# newest daemon first; the default PID files cover a start whose PID list was lost
ENTRIES="slurmd:/run/slurmd.pid slurmctld:/run/slurmctld.pid slurmdbd:/run/slurmdbd.pid"
ENTRIES="$ENTRIES mariadbd:/run/mysqld/mysqld.pid munged:/run/munge/munged.pid"
if [ -s "$PIDLIST" ]; then
  listed=$(tac "$PIDLIST" | awk '{print $1 ":" $2}' | tr '\n' ' ')
  ENTRIES="$listed $ENTRIES"
fi

# Jobs of our own test cluster only (ClusterName set by start_slurm.sh).
if command -v scontrol >/dev/null && [ -s /run/slurmctld.pid ] &&
  timeout 10 scontrol show config 2>/dev/null | grep -Eq '^ClusterName += mokbenchci$'; then
  timeout 10 scancel --user="$(id -un)" 2>/dev/null || true
  for _ in $(seq 50); do
    [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
    sleep 0.2
  done
fi

stopped=""
pids=""
seen=" "
for ent in $ENTRIES; do
  name=${ent%%:*}
  pf=${ent#*:}
  case "$seen" in *" $pf "*) continue ;; esac
  seen="$seen$pf "
  [ -s "$pf" ] || continue
  pid=$(tr -dc '0-9' <"$pf")
  if [ -n "$pid" ] && [ "$(ps -o comm= -p "$pid" 2>/dev/null)" = "$name" ]; then
    kill -TERM "$pid" 2>/dev/null && { pids="$pids $pid"; stopped="$stopped $name($pid)"; }
  fi
  rm -f "$pf" # slurmctld/slurmdbd leave stale PID files (they break `apt-get purge slurmctld`)
done
for pid in $pids; do
  for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && echo "stop_slurm: PID $pid still running after 15 s" >&2
done
rm -f "$PIDLIST"
[ $QUIET = 1 ] || echo "stop_slurm: stopped${stopped:- nothing}"
exit 0
