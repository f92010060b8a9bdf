#!/bin/bash
# After the main campaign: 5 gates against a smaller planted slowdown (gate-planted-slowdown-x4: the forward twin's
# expert GEMMs done 4 times) and 2 A/A gates judged at a threshold this CPU resolves (--threshold 50%).
while kill -0 $(cat /work/gate-measurements/campaign/pid) 2>/dev/null; do sleep 20; done
source /work/venv/bin/activate
cd /work/wt-gate
M=/work/gate-measurements/campaign
export PYTHONPATH=/work/gate-measurements/gate-src
for i in 30 31 32 33 34 35 36; do
  if (( i < 35 )); then name=plantedx4-$i; cmd="python3 -m harness.gate 5dfdf63 gate-planted-slowdown-x4 --backend mok_hopper --out $M/results --name $name -- backends=[nccl,mok_hopper]"
  else name=aa50-$i; cmd="python3 -m harness.gate 5dfdf63 5dfdf63 --backend mok_hopper --threshold 50% --out $M/results --name $name -- backends=[nccl,mok_hopper]"; fi
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
echo extra-done >> $M/index.txt
