#!/usr/bin/env bash
# On this machine, before the device calls: the gate trees gates.sh reads from .device/ (ignored; carry it).
#   base.tgz   = ee304c4 (the tiled weight copy, padded rows: the code the memory issue measured first)
#   plain.tgz  = HEAD as it is (weights=plain, rows=padded by default)
#   packed.tgz = HEAD with mok_hopper.rows defaulting to packed (at its default an option stays out of the hash, so
#                its rows match plain.tgz's in the gate)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .device
git archive ee304c4 | gzip > .device/base.tgz
git archive HEAD | gzip > .device/plain.tgz
tmp=$(mktemp -d)
git archive HEAD | tar -x -C "$tmp"
sed -i 's/    rows: str = option("padded"/    rows: str = option("packed"/' "$tmp/mok_kernels/mok_hopper/options.py"
grep -q 'rows: str = option("packed"' "$tmp/mok_kernels/mok_hopper/options.py" || { echo "the rows option moved"; exit 1; }
tar -czf .device/packed.tgz -C "$tmp" .
rm -rf "$tmp"
ls -la .device/
