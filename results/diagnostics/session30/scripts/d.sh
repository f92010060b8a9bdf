#!/bin/bash
# session 30 call D: SonicMoE on qwen3_5_397b alone, QuACK's compiled kernels kept in QUACK_CACHE_DIR (its .o cache;
# the compile key has no problem sizes), and that cache brought back (tar.xz in parts) to carry in later sessions
export MOKBENCH_GIT_SHA=$1 MOKBENCH_RUN_ID=$2
S=/tmp/site
mkdir -p $S /tmp/sonicwhl && tar xJf .device/sonicx/cu13.tar.xz -C $S && cp .device/sonicx/*.whl /tmp/sonicwhl/
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,driver_version --format=csv > $OUT/smi.txt
source scripts/gpu_env.sh .whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S /tmp/sonicwhl/*.whl
export PYTHONPATH=$S:$S/nvidia_cutlass_dsl/python_packages:$PYTHONPATH
export QUACK_CACHE_DIR=/tmp/qcache QUACK_COMPILE_WORKERS=16 QUACK_PRINT_AUTOTUNING=1
T0=$(date +%s)
timeout 420 python3 -m harness.run -m hydra/launcher=node shape=qwen3_5_397b ep_size=1 precision=bf16 \
  direction=fwd_and_bwd 'backends=[sonicmoe]' compile=false timing=published calibrate=true run_id=$MOKBENCH_RUN_ID \
  results_dir=/tmp/anch/runs hydra.run.dir=/tmp/mokbench-run hydra.sweep.dir=/tmp/mokbench-sweep > $OUT/sonic.log 2>&1
echo "rc $? after $(( $(date +%s) - T0 )) s" >> $OUT/sonic.log
pkill -f quack._compile_worker; sleep 2
echo "cache: $(find /tmp/qcache -type f | wc -l) files, $(du -sb /tmp/qcache | cut -f1) bytes" >> $OUT/sonic.log
find /tmp/qcache -type f -printf '%s %p\n' | sort -n | tail -5 >> $OUT/sonic.log
tar cf - -C /tmp qcache | xz -T16 -6 | split -b 15000000 -a 1 - $OUT/qcache.tar.xz.part-
ls -la $OUT >> $OUT/sonic.log
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader >> $OUT/smi.txt
PYTHONPATH=/tmp/mokbench-site:$PWD python3 scripts/merge_results.py /tmp/anch/runs $OUT > $OUT/rows.txt 2>&1
