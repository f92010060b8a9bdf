"""The wheels of the Hopper anchors that need a folder of their own (SonicMoE, FlashInfer), for a GPU machine without
network access, in bundles that each fit one transfer.

    python3 scripts/anchor_wheels.py OUT [--max-mib 50] [--anchors sonicmoe,flashinfer] [--no-download]

On a machine with the package index: ``pip download --no-deps`` of each anchor's wheels (:data:`WHEELS`, for the
GPU image: CPython 3.12, x86-64 Linux, CUDA 13) into ``OUT/wheels/<anchor>/``; each wheel larger than the bundle
size is split into ``NAME.whl.part-aa``, ``-ab``, ... (what ``scripts/gpu_env.sh`` joins); then every file is packed
into ``OUT/bundle-NN/<anchor>/`` folders of at most ``--max-mib`` MiB each (largest files first, each into the first
bundle with room), and ``OUT/bundles.txt`` lists them. Carry the bundles to the GPU machine in that order (one
transfer each), then ``source scripts/anchor_sites.sh OUT`` there
(docs/backends.md, 'Offline install of the Hopper anchors'). ``--no-download`` packs the wheels already in
``OUT/wheels``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20
# anchor -> the wheels of its own folder (pinned; installed with --no-deps beside the image's torch 2.11 + CUDA 13, all
# of one folder in one pip call: several of them write into the same nvidia_cutlass_dsl/ folder, which a second
# `pip --target` call would skip or replace)
WHEELS = {
    "sonicmoe": ("sonic-moe==0.1.2.post1", "quack-kernels==0.3.11", "nvidia-cutlass-dsl==4.4.2",
                 "nvidia-cutlass-dsl-libs-base==4.4.2", "nvidia-cutlass-dsl-libs-cu13==4.4.2",
                 "apache-tvm-ffi==0.1.15.post2", "torch-c-dlpack-ext==0.1.5"),
    "flashinfer": ("flashinfer-python==0.7.2.post1", "nvidia-cutlass-dsl==4.8.1", "nvidia-cutlass-dsl-libs-base==4.8.1",
                   "nvidia-cutlass-dsl-libs-core==4.8.1", "nvidia-cutlass-dsl-libs-cu13==4.8.1", "protobuf==7.36.2",
                   "apache-tvm-ffi==0.1.15.post2", "cuda-python==13.4.4",
                   "cuda-bindings==13.4.4", "cuda-core==1.2.2", "cuda-pathfinder==1.9.1", "cuda-tile==1.7.0",
                   "nccl4py==0.6.0", "nccl-extensions==0.1.0", "nvidia-cudnn-frontend==1.32.0",
                   "nvidia-ml-py==13.615.71", "einops==0.8.2", "tabulate==0.10.0", "click==8.5.1", "ninja==1.13.2"),
}
PLATFORM = ("--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *[a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                          "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any") for a in ("--platform", p)])


def download(anchor: str, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", *PLATFORM, "-d", str(dest),
                    *WHEELS[anchor]], check=True)


def split_large(folder: Path, limit: int) -> None:
    """Each wheel in ``folder`` over ``limit`` bytes becomes ``NAME.whl.part-aa``, ``-ab``, ... of ``limit`` bytes at
    most (``split``'s names; ``scripts/gpu_env.sh`` joins them)."""
    for whl in sorted(folder.glob("*.whl")):
        if whl.stat().st_size <= limit:
            continue
        with whl.open("rb") as f:
            for n in range(26 * 26):
                chunk = f.read(limit)
                if not chunk:
                    break
                (folder / f"{whl.name}.part-{chr(97 + n // 26)}{chr(97 + n % 26)}").write_bytes(chunk)
        whl.unlink()


def pack(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Names into bundles of at most ``limit`` bytes: largest first, each into the first bundle with room (a name
    larger than ``limit`` is an error: split it first)."""
    bundles: list[list[str]] = []
    room: list[int] = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        if sizes[name] > limit:
            raise ValueError(f"{name} ({sizes[name]} bytes) is larger than a bundle ({limit} bytes): split it")
        for i, free in enumerate(room):
            if sizes[name] <= free:
                bundles[i].append(name)
                room[i] -= sizes[name]
                break
        else:
            bundles.append([name])
            room.append(limit - sizes[name])
    return bundles


def make_bundles(out: Path, anchors: list[str], limit: int) -> list[Path]:
    """``out/wheels/<anchor>/*`` packed into ``out/bundle-NN/<anchor>/`` (copies); returns the bundle folders."""
    files = {f"{a}/{p.name}": p for a in anchors for p in sorted((out / "wheels" / a).iterdir()) if p.is_file()}
    for old in out.glob("bundle-*"):
        shutil.rmtree(old)
    folders = []
    lines = []
    for i, names in enumerate(pack({n: p.stat().st_size for n, p in files.items()}, limit), start=1):
        folder = out / f"bundle-{i:02d}"
        for name in names:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(files[name], folder / name)
        total = sum(files[n].stat().st_size for n in names)
        lines.append(f"{folder.name}  {total / MIB:6.1f} MiB  " + " ".join(sorted(names)))
        folders.append(folder)
    (out / "bundles.txt").write_text("\n".join(lines) + "\n")
    return folders


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--max-mib", type=float, default=50.0)
    ap.add_argument("--anchors", default=",".join(WHEELS))
    ap.add_argument("--no-download", action="store_true")
    args = ap.parse_args(argv)
    anchors = [a for a in args.anchors.split(",") if a]
    unknown = [a for a in anchors if a not in WHEELS]
    if unknown or args.max_mib <= 0:
        print(f"anchor_wheels: {'unknown anchor ' + ', '.join(unknown) if unknown else '--max-mib must be > 0'}; "
              f"choose from {', '.join(WHEELS)}", file=sys.stderr)
        return 2
    limit = int(args.max_mib * MIB)
    for a in anchors:
        if not args.no_download:
            download(a, args.out / "wheels" / a)
        split_large(args.out / "wheels" / a, limit)
    folders = make_bundles(args.out, anchors, limit)
    print((args.out / "bundles.txt").read_text(), end="")
    print(f"{len(folders)} bundles of at most {args.max_mib:g} MiB in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
