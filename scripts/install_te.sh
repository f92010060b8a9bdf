# Install Transformer Engine 2.20.2 (PyTorch) and megatron-core on a GPU machine without network, from a folder.
#
#   source scripts/install_te.sh [options] WHEEL_DIR      # installs, then exports PYTHONPATH in this shell
#   bash scripts/install_te.sh [options] WHEEL_DIR        # installs; then: source <site>/env.sh
#
# WHEEL_DIR holds (filled on a machine with network, see docs/backends.md, 'Transformer Engine and Megatron-core'):
#   * the TE core wheel transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl (276 MB), or its parts
#     <that name>.part* (made with `split -b 60M -d WHEEL WHEEL.part`; joined here in name order), or --core PATH;
#     or, for Hopper only, te_core_slim.tar.xz: the same package tree with only the sm_90 kernels (26 MB);
#   * the small wheels, installed as they are: transformer_engine (meta), pydantic, pydantic-core, annotated-types,
#     typing-inspection, typing-extensions, importlib-metadata, zipp, nvdlfw-inspect, nvidia-cudnn-frontend, einops,
#     megatron-core;
#   * build tools for the extension (used only while building, never installed): setuptools, wheel, ninja;
#   * the torch extension, either prebuilt (a tarball this script packed, transformer_engine_torch-*-ext-*.tar.gz,
#     or --ext TARBALL|DIR) or its source, transformer_engine_torch-2.20.2.tar.gz, built here against the installed
#     torch (CppExtension, about 2 minutes with 16 jobs).
#
# Options:
#   --site DIR   install location (default /tmp/te-site); everything goes in with pip --target, nothing else is touched
#   --core PATH  the already joined core wheel, or a tarball of the core package tree (transformer_engine/ + dist-info)
#   --ext PATH   a prebuilt extension (tarball or folder with transformer_engine/wheel_lib/transformer_engine_torch*.so)
#   --out DIR    pack the extension built here into DIR/transformer_engine_torch-2.20.2-ext-torch<ver>-cp<py>.tar.gz
#                for reuse (it only fits the same torch version and Python)
#   --jobs N     parallel compile jobs (default 16);  --archs A   NVTE_CUDA_ARCHS (default 90)
#
# TE's loader looks for the extension in the core package's own transformer_engine/wheel_lib/ folder (next to
# libtransformer_engine.so), so the built .so is merged there, with its dist-info next to the others.
# Environment: PYTHON (default python3: the interpreter that has torch), CUDA_HOME (default /usr/local/cuda).

_te_install() (
  set -euo pipefail
  local site=/tmp/te-site core="" ext="" out="" jobs=16 archs=90 dir=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --site) site=$2; shift 2 ;;
      --core) core=$2; shift 2 ;;
      --ext) ext=$2; shift 2 ;;
      --out) out=$2; shift 2 ;;
      --jobs) jobs=$2; shift 2 ;;
      --archs) archs=$2; shift 2 ;;
      -h|--help) sed -n '2,30p' "${BASH_SOURCE[0]}"; exit 0 ;;
      -*) echo "install_te: unknown option $1" >&2; exit 2 ;;
      *) dir=$1; shift ;;
    esac
  done
  [ -n "$dir" ] && [ -d "$dir" ] || { echo "install_te: give the wheel folder (see --help)" >&2; exit 2; }
  dir=$(cd "$dir" && pwd)
  local py=${PYTHON:-python3} version=2.20.2
  mkdir -p "$site"
  site=$(cd "$site" && pwd)
  local work=${site}.build
  local pip=("$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check)
  mkdir -p "$work"

  # 1. the core package: the wheel (given, whole in the folder, or joined from parts) or the sm_90-only tarball
  local name=transformer_engine_cu13-$version-py3-none-manylinux_2_28_x86_64.whl
  if [ -z "$core" ]; then
    if [ -f "$dir/$name" ]; then
      core=$dir/$name
    elif ls "$dir/$name".part* >/dev/null 2>&1; then
      core=$work/$name
      echo "install_te: joining $(ls "$dir/$name".part* | wc -l) parts of the core wheel"
      ls "$dir/$name".part* | sort -V | xargs cat > "$core"
    elif [ -f "$dir/te_core_slim.tar.xz" ]; then
      core=$dir/te_core_slim.tar.xz
    else
      echo "install_te: no $name (or its .part* files, or te_core_slim.tar.xz) in $dir; pass --core PATH" >&2
      exit 1
    fi
  fi
  case "$core" in
    *.whl) "$py" -m zipfile -t "$core" >/dev/null || { echo "install_te: $core is not a complete wheel" >&2; exit 1; } ;;
    *.tar|*.tar.*|*.tgz) ;;
    *) echo "install_te: --core takes the core wheel or a tarball of its tree, not $core" >&2; exit 1 ;;
  esac

  # 2. the wheels, into one --target folder (one pip call, so the meta and core wheels merge)
  local tools=() wheels=()
  local w
  case "$core" in *.whl) wheels+=("$core") ;; esac
  for w in "$dir"/*.whl; do
    case "$(basename "$w")" in
      transformer_engine_cu13-*) ;;  # the core wheel, handled above
      setuptools-*|wheel-*|ninja-*) tools+=("$w") ;;
      *) wheels+=("$w") ;;
    esac
  done
  echo "install_te: installing ${#wheels[@]} wheels into $site"
  "${pip[@]}" --upgrade --target "$site" "${wheels[@]}"
  case "$core" in
    *.whl) ;;
    *) echo "install_te: unpacking the core package tree $core"  # after pip: pip --upgrade replaces whole folders
       tar -xf "$core" -C "$site"
       [ -f "$site/transformer_engine/wheel_lib/libtransformer_engine.so" ] || {
         echo "install_te: $core has no transformer_engine/wheel_lib/libtransformer_engine.so" >&2; exit 1; } ;;
  esac

  # 3. the torch extension: prebuilt, or built from the sdist against this torch
  local built=$work/ext
  rm -rf "$built" && mkdir -p "$built"
  if [ -z "$ext" ]; then
    ext=$(ls "$dir"/transformer_engine_torch-$version-ext-*.tar.gz 2>/dev/null | head -1 || true)
  fi
  if [ -n "$ext" ]; then
    echo "install_te: reusing the prebuilt extension $ext"
    if [ -d "$ext" ]; then cp -r "$ext"/. "$built"/; else tar -xzf "$ext" -C "$built"; fi
  else
    local sdist=$dir/transformer_engine_torch-$version.tar.gz
    [ -f "$sdist" ] || { echo "install_te: no prebuilt extension and no $sdist" >&2; exit 1; }
    local cuda=${CUDA_HOME:-/usr/local/cuda}
    [ -x "$cuda/bin/nvcc" ] || { echo "install_te: no nvcc under CUDA_HOME=$cuda (set CUDA_HOME)" >&2; exit 1; }
    local tooldir=$work/tools
    rm -rf "$tooldir"
    if [ ${#tools[@]} -gt 0 ]; then "${pip[@]}" --target "$tooldir" "${tools[@]}"; fi
    # headers TE's build does not add itself: cuDNN and NCCL from torch's nvidia wheels, CCCL of CUDA 13
    local inc
    inc=$("$py" - "$cuda" <<'EOF'
import glob, os, sys
dirs = [os.path.join(sys.argv[1], "include", "cccl")]
try:
    import nvidia
    for root in nvidia.__path__:
        dirs += sorted(glob.glob(os.path.join(root, "*", "include")) + glob.glob(os.path.join(root, "cu*", "include")))
except ImportError:
    pass
print(":".join(d for d in dict.fromkeys(dirs) if os.path.isdir(d)))
EOF
)
    echo "install_te: building transformer_engine_torch $version (NVTE_CUDA_ARCHS=$archs, $jobs jobs)"
    local t0=$SECONDS
    CUDA_HOME=$cuda NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=$archs MAX_JOBS=$jobs NVTE_PYTORCH_FORCE_BUILD=TRUE \
      NVTE_NO_LOCAL_VERSION=1 CPATH="$inc${CPATH:+:$CPATH}" PATH="$tooldir/bin:$PATH" \
      PYTHONPATH="$tooldir${PYTHONPATH:+:$PYTHONPATH}" TMPDIR="$work" \
      "$py" -m pip install --no-build-isolation --no-deps --no-index --no-cache-dir --disable-pip-version-check \
      --target "$built" "$sdist"
    echo "install_te: built in $((SECONDS - t0)) s"
  fi
  local so
  so=$(ls "$built"/transformer_engine/wheel_lib/transformer_engine_torch*.so "$built"/transformer_engine_torch*.so \
       2>/dev/null | head -1 || true)
  [ -n "$so" ] || { echo "install_te: no transformer_engine_torch*.so in the extension" >&2; exit 1; }

  # 4. merge: exactly one extension .so, in wheel_lib (TE refuses several), and its dist-info
  rm -f "$site"/transformer_engine_torch*.so "$site"/transformer_engine/transformer_engine_torch*.so \
        "$site"/transformer_engine/wheel_lib/transformer_engine_torch*.so
  cp "$so" "$site/transformer_engine/wheel_lib/"
  rm -rf "$site"/transformer_engine_torch-*.dist-info
  cp -r "$built"/transformer_engine_torch-*.dist-info "$site"/ 2>/dev/null || true

  if [ -n "$out" ] && [ -z "$ext" ]; then
    local tv pv tarball pack
    tv=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')
    pv=$("$py" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
    mkdir -p "$out"
    tarball=$out/transformer_engine_torch-$version-ext-torch$tv-cp$pv.tar.gz
    pack=$work/pack
    rm -rf "$pack" && mkdir -p "$pack/transformer_engine/wheel_lib"
    cp "$so" "$pack/transformer_engine/wheel_lib/"
    cp -r "$built"/transformer_engine_torch-*.dist-info "$pack"/ 2>/dev/null || true
    tar -czf "$tarball" -C "$pack" .
    echo "install_te: packed the extension into $tarball"
  fi

  printf 'export PYTHONPATH=%s${PYTHONPATH:+:$PYTHONPATH}\n' "$site" > "$site/env.sh"
  # 5. check: TE loads with its extension, megatron-core imports
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$py" -c '
from importlib.metadata import version
import transformer_engine.pytorch as te, transformer_engine_torch as tex
print("install_te: transformer_engine", version("transformer_engine"), "extension", tex.__file__)
try:
    import megatron.core
    print("install_te: megatron-core", megatron.core.__version__)
except ImportError as e:
    print("install_te: megatron-core not importable:", e)
'
)

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then  # sourced: install, then export PYTHONPATH here
  _te_site=/tmp/te-site
  _te_prev=""
  for _te_a in "$@"; do [ "$_te_prev" = "--site" ] && _te_site=$_te_a; _te_prev=$_te_a; done
  if _te_install "$@"; then
    case ":${PYTHONPATH:-}:" in *":$_te_site:"*) ;; *) export PYTHONPATH=$_te_site${PYTHONPATH:+:$PYTHONPATH} ;; esac
    echo "install_te: PYTHONPATH=$PYTHONPATH"
  else
    echo "install_te: failed" >&2
  fi
  unset _te_site _te_prev _te_a
  unset -f _te_install
else
  _te_install "$@" || exit $?
  echo "install_te: done; in your shell: source <site>/env.sh (default /tmp/te-site/env.sh)"
fi
