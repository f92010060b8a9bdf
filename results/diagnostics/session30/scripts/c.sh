#!/bin/bash
# session 30 call C: SonicMoE with torch 2.11 (QuACK autotuning in its setup, 16 compile workers, progress printed)
# beside mok_hopper and Liger (autotuned) on qwen3_5_397b, one process
export MOKBENCH_GIT_SHA=$1 MOKBENCH_RUN_ID=$2
S=/tmp/site
mkdir -p $S /tmp/sonicwhl && tar xJf .device/sonicx/cu13.tar.xz -C $S && cp .device/sonicx/*.whl /tmp/sonicwhl/
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,driver_version --format=csv > $OUT/smi.txt
export SONIC_WHEELS=/tmp/sonicwhl COMPILE=false BACKENDS='[mok_hopper,liger,sonicmoe]' QUACK_PRINT_AUTOTUNING=1
timeout 570 bash scripts/h200_anchors_run.sh /tmp/anch qwen > $OUT/anchors.log 2>&1
echo "rc $?" >> $OUT/anchors.log
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader >> $OUT/smi.txt
PYTHONPATH=/tmp/site:$PWD python3 scripts/merge_results.py /tmp/anch/runs $OUT > $OUT/rows.txt 2>&1
