# Source on a GPU machine that has torch but not the harness's pure-Python dependencies:
#   source scripts/gpu_env.sh [WHEEL_DIR]
# Installs the wheels in WHEEL_DIR (default .whl; built elsewhere with `pip download`/`pip wheel`) into
# /tmp/mokbench-site without touching the system packages, and sets the environment every GPU run uses.
_whl=${1:-.whl}
if [ -d "$_whl" ] && ls "$_whl"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/mokbench-site "$_whl"/*.whl || return 1
  export PYTHONPATH=/tmp/mokbench-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# NVLink multicast stays off (shared hosts); unbuffered output for logs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
