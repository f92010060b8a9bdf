#!/usr/bin/env bash
# Plain-sbatch sweeps, for sites that prefer sbatch to submitit. The sweep is expanded and validated by the same
# dry run as the submitit launcher (a bad point: its message, exit 2, nothing submitted); then every point is one
# `sbatch slurm/mokbench.sbatch` with the preset's resources (configs/hydra/launcher/<preset>.yaml).
#
#   slurm/submit.sh <preset> [hydra overrides; comma lists sweep]
#   slurm/submit.sh h200_8gpu hydra.launcher.partition=gpu shape=kimi_k2_7,glm_5_2 precision=bf16,fp8 direction=fwd,bwd
#   python -m harness.slurm collect <sweep dir>   # waits for the jobs; rows for jobs that died before reporting
#
# Environment: MOKBENCH_SWEEP_DIR (default multirun/sbatch-<time>), SBATCH_EXTRA (more sbatch flags),
# PYTHON (default python; the jobs use the same one). Run from anywhere; jobs start in the repository root.
set -euo pipefail
if [ $# -lt 1 ]; then
  sed -n '2,12p' "$0"
  exit 1
fi
preset=$1
shift
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python}
PYBIN=$(command -v "$PY") # the jobs use this interpreter too
sweep_dir=${MOKBENCH_SWEEP_DIR:-multirun/sbatch-$(date +%Y%m%d-%H%M%S)}
case "$sweep_dir" in /*) ;; *) sweep_dir=$ROOT/$sweep_dir ;; esac

# expand + validate (exit 2 on a bad point); writes plan.tsv, setup.sh and <num>/mokbench.yaml
"$PY" -m harness.run -m "hydra/launcher=$preset" hydra.launcher.dry_run=true "hydra.sweep.dir=$sweep_dir" "$@"

jobs=$sweep_dir/sbatch_jobs.tsv
: >"$jobs"
n=0
while IFS=$'\t' read -r num nodes tpn gpn cpt minutes partition account qos flags run_id overrides; do
  [ "$num" = num ] && continue
  args=(--parsable --job-name="mokbench-$num" --nodes="$nodes" --ntasks-per-node="$tpn"
    --output="$sweep_dir/$num/slurm-%j.out")
  # plan.tsv writes "-" for an empty field
  [ "$gpn" != - ] && args+=(--gpus-per-node="$gpn")
  [ "$cpt" != - ] && args+=(--cpus-per-task="$cpt")
  [ "$minutes" != - ] && args+=(--time="$minutes")
  [ "$partition" != - ] && args+=(--partition="$partition")
  [ "$account" != - ] && args+=(--account="$account")
  [ "$qos" != - ] && args+=(--qos="$qos")
  [ "$flags" != - ] && read -r -a more <<<"$flags" && args+=("${more[@]}")
  if [ -n "${SBATCH_EXTRA:-}" ]; then read -r -a more <<<"$SBATCH_EXTRA" && args+=("${more[@]}"); fi
  eval "point=($overrides)"
  jid=$(MOKBENCH_SETUP="$sweep_dir/setup.sh" MOKBENCH_PYTHON="$PYBIN" sbatch "${args[@]}" "$ROOT/slurm/mokbench.sbatch" \
    "${point[@]}" "run_id=$run_id" "hydra.run.dir=$sweep_dir/$num")
  jid=${jid%%;*}
  printf '%s\t%s\n' "$num" "$jid" >>"$jobs"
  echo "#$num -> job $jid: ${point[*]}"
  n=$((n + 1))
  last_run_id=$run_id
done <"$sweep_dir/plan.tsv"
echo "submitted $n jobs; their rows go to <results_dir>/${last_run_id:-?}/"
echo "when they have ended (or to wait for them): $PY -m harness.slurm collect $sweep_dir"
