# Source on a GPU machine that has torch but not the harness's pure-Python dependencies:
#   source scripts/gpu_env.sh [WHEEL_DIR ...]
# Installs the wheels in each WHEEL_DIR (default .whl; built elsewhere with `pip download`/`pip wheel`; a wheel too
# large for one transfer may come as parts made with `split`, NAME.whl.part-aa, -ab, ..., joined here first) into
# MOKBENCH_SITE (default /tmp/mokbench-site) without touching the system packages, and sets the environment every
# GPU run uses.
_site=${MOKBENCH_SITE:-/tmp/mokbench-site}
_whls=()
for _dir in "${@:-.whl}"; do
  for _first in "$_dir"/*.whl.part-aa; do
    [ -e "$_first" ] || continue
    [ -e "${_first%.part-aa}" ] || cat "${_first%.part-aa}".part-* > "${_first%.part-aa}" || return 1
  done
  for _w in "$_dir"/*.whl; do [ -e "$_w" ] && _whls+=("$_w"); done
done
if [ ${#_whls[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$_site" \
    "${_whls[@]}" || return 1
  # pip --target does not run the .pth files a wheel installs (nvidia-cutlass-dsl's puts its python_packages
  # folder on the path): the folders they name go on PYTHONPATH
  _path=$_site
  for _pth in "$_site"/*.pth; do
    [ -e "$_pth" ] || continue
    while IFS= read -r _line || [ -n "$_line" ]; do
      case $_line in ''|'#'*|import*) continue ;; esac
      [ -d "$_site/$_line" ] && _path="$_path:$_site/$_line"
    done < "$_pth"
  done
  export PYTHONPATH=$_path:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# NVLink multicast stays off (shared hosts); unbuffered output for logs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
