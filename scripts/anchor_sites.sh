# Source on the GPU machine, after the bundles of scripts/anchor_wheels.py came over:
#   source scripts/anchor_sites.sh BUNDLES_DIR [ANCHOR ...]        (ANCHOR: sonicmoe, flashinfer; default both)
# Gathers each anchor's files from BUNDLES_DIR/bundle-*/<anchor>/, installs them (split wheels joined) into a folder
# of its own, MOKBENCH_<ANCHOR>_SITE (default /tmp/mokbench-site-<anchor>), with scripts/gpu_env.sh in a subshell
# (this shell's PYTHONPATH stays as it is), and exports MOKBENCH_<ANCHOR>_SITE, which +experiment=hopper_anchors
# puts first on that anchor's own processes' path (own_pythonpath).
_bundles=${1:?the folder that holds bundle-NN/ (scripts/anchor_wheels.py)}
shift
_anchors=("$@")
[ ${#_anchors[@]} -gt 0 ] || _anchors=(sonicmoe flashinfer)
for _a in "${_anchors[@]}"; do
  _var=MOKBENCH_$(printf %s "$_a" | tr '[:lower:]' '[:upper:]')_SITE
  _dest=${!_var:-/tmp/mokbench-site-$_a}
  _w=/tmp/mokbench-wheels-$_a
  rm -rf "$_w" && mkdir -p "$_w" || return 1
  _n=0
  for _f in "$_bundles"/bundle-*/"$_a"/*; do
    [ -f "$_f" ] || continue
    cp "$_f" "$_w"/ && _n=$((_n + 1)) || return 1
  done
  if [ "$_n" = 0 ]; then
    echo "anchor_sites: no files of $_a in $_bundles/bundle-*/$_a/: carry the bundles of scripts/anchor_wheels.py first" >&2
    return 1
  fi
  (MOKBENCH_SITE=$_dest; source scripts/gpu_env.sh "$_w") || return 1
  export "$_var=$_dest"
  echo "anchor_sites: $_a installed into $_dest ($_n files); $_var=$_dest"
done
