#!/bin/bash
# session 30 call B: SonicMoE with torch 2.11: nvidia-cutlass-dsl-libs-cu13 4.4.2 (its wheel's files, carried as a
# tar.xz to fit one call) and the small wheels; if sonicmoe imports, the anchors' qwen point (nccl eager, Liger
# autotuned, sonicmoe, mok_hopper), else its unsupported rows
export MOKBENCH_GIT_SHA=$1 MOKBENCH_RUN_ID=$2
S=/tmp/site
mkdir -p $S /tmp/sonicwhl && tar xJf .device/sonicx/cu13.tar.xz -C $S && cp .device/sonicx/*.whl /tmp/sonicwhl/
ls -la $S /tmp/sonicwhl > $OUT/sonic.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,driver_version --format=csv > $OUT/smi.txt
python3 -m pip list 2>/dev/null | grep -i -e cuda -e tvm -e dlpack -e ninja -e "^torch " >> $OUT/sonic.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S \
  /tmp/sonicwhl/*.whl >> $OUT/sonic.txt 2>&1
PYTHONPATH=$S:$S/nvidia_cutlass_dsl/python_packages timeout 120 python3 -c "
import torch, cutlass, quack, sonicmoe, importlib.metadata as m
print('imports ok', torch.__version__, 'sonic', m.version('sonic-moe'), 'quack', m.version('quack-kernels'))
" >> $OUT/sonic.txt 2>&1
IMPORT_RC=$?
echo "import rc $IMPORT_RC" >> $OUT/sonic.txt
export SONIC_WHEELS=/tmp/sonicwhl COMPILE=false
if [ $IMPORT_RC = 0 ]; then
  timeout 560 bash scripts/h200_anchors_run.sh /tmp/anch qwen > $OUT/anchors.log 2>&1
else
  source scripts/gpu_env.sh .whl; export PYTHONPATH=$S:$S/nvidia_cutlass_dsl/python_packages:$PYTHONPATH
  timeout 200 python3 -m harness.run -m hydra/launcher=node shape=qwen3_5_397b ep_size=1 precision=bf16 \
    direction=fwd_and_bwd 'backends=[sonicmoe]' compile=false timing=published calibrate=true run_id=$MOKBENCH_RUN_ID \
    results_dir=/tmp/anch/runs hydra.run.dir=/tmp/mokbench-run hydra.sweep.dir=/tmp/mokbench-sweep > $OUT/anchors.log 2>&1
fi
echo "rc $?" >> $OUT/anchors.log
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader >> $OUT/smi.txt
cp /tmp/anch/precompile.log $OUT/ 2>/dev/null
PYTHONPATH=/tmp/site:/tmp/mokbench-site:$PWD python3 scripts/merge_results.py /tmp/anch/runs $OUT > $OUT/rows.txt 2>&1
