#!/bin/bash
# 30 gate invocations on this CPU machine: 20 A/A pairs (5dfdf63 against itself) and 10 planted-slowdown pairs
# (5dfdf63 against gate-planted-slowdown: the forward twin's expert GEMMs done 10 times), interleaved.
# The gate's code is frozen at 5dfdf63 (git archive in /work/gate-measurements/gate-src).
source /work/venv/bin/activate
cd /work/wt-gate
M=/work/gate-measurements/campaign
export PYTHONPATH=/work/gate-measurements/gate-src
for i in $(seq -w 0 29); do
  if (( 10#$i % 3 == 1 )); then kind=planted; new=gate-planted-slowdown; else kind=aa; new=5dfdf63; fi
  name=$kind-$i
  cmd="python3 -m harness.gate 5dfdf63 $new --backend mok_hopper --out $M/results --name $name -- backends=[nccl,mok_hopper]"
  {
    echo "# $cmd"
    echo "# start $(date -Is) uptime: $(uptime)"
    t0=$(date +%s)
    $cmd 2>&1
    rc=$?
    echo "# exit $rc after $(( $(date +%s) - t0 )) s; end $(date -Is) uptime: $(uptime)"
  } > $M/$name.txt
  echo "$name rc=$(tail -1 $M/$name.txt)" >> $M/index.txt
done
echo done >> $M/index.txt
