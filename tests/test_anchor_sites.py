"""Anchors whose packages conflict (SonicMoE: nvidia-cutlass-dsl 4.4.2; FlashInfer: >= 4.6.2a0), on the CPU: each runs
in processes of its own with its own folder first on the path (own_process, own_pythonpath, the folders its ``.pth``
files name), the bundles that bring their wheels to a machine without network (scripts/anchor_wheels.py,
scripts/anchor_sites.sh), and the preset that runs them (configs/experiment/hopper_anchors.yaml)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, compose_cfg, cpu_cfg

sys.path.insert(0, str(ROOT / "scripts"))
import anchor_wheels as W  # noqa: E402


def plant_site(site: Path) -> Path:
    """A ``pip --target`` folder as the nvidia-cutlass-dsl wheels leave one, with packages only there: a stand-in
    ``sonicmoe`` in a folder that a ``.pth`` line names (4.4.2's ``python_packages``), and a stand-in ``flashinfer``
    in a folder that a ``.pth`` import line adds (4.8.1's ``dsl_packages``). A found ``flashinfer`` makes its row
    name the missing GPU instead of the missing package."""
    (site / "python_packages" / "sonicmoe").mkdir(parents=True)
    (site / "python_packages" / "sonicmoe" / "__init__.py").write_text("")
    (site / "planted_dsl" / "dsl_packages" / "flashinfer").mkdir(parents=True)
    (site / "planted_dsl" / "__init__.py").write_text("")
    (site / "planted_dsl" / "dsl_packages" / "flashinfer" / "__init__.py").write_text("")
    (site / "a_folder.pth").write_text("# a comment\npython_packages\nno_such_folder\n")
    (site / "b_import.pth").write_text("import sys, os, planted_dsl; sys.path.insert(0, os.path.join("
                                       "planted_dsl.__path__[0], 'dsl_packages'))\n")
    return site


def test_add_site_puts_the_folder_and_what_its_pth_files_add_first(tmp_path):
    site = plant_site(tmp_path / "site")
    other = tmp_path / "other"
    other.mkdir()
    code = ("import sys; from harness.measure.env import add_site; import json; "
            f"added = add_site({str(site) + os.pathsep + str(other)!r}); "
            "import flashinfer, sonicmoe; print(json.dumps([added, sys.path[:len(added)], flashinfer.__file__, "
            "sonicmoe.__file__]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr
    import json

    added, head, fi, sonic = json.loads(r.stdout)
    dsl = str(site / "planted_dsl" / "dsl_packages")
    assert added == head and set(added) == {dsl, str(site), str(other), str(site / "python_packages")}
    assert added.index(str(site)) < added.index(str(other))
    assert fi.startswith(dsl) and sonic.startswith(str(site / "python_packages"))


@pytest.mark.slow
def test_a_conflicting_anchor_runs_in_processes_of_its_own_with_its_own_path(results_dir, tmp_path):
    """flashinfer in processes of its own, its folder (and the folder its .pth names) first on their path: its
    stand-in package is found there (the row names the missing GPU, not the package). sonicmoe runs in the point's
    first processes, without that folder: its stand-in, planted in the same folder, is not found there."""
    from harness.measure.runner import run_benchmark

    assert "flashinfer" not in sys.modules and not any(p.endswith("_packages") for p in sys.path)
    site = plant_site(tmp_path / "site")
    df = run_benchmark(cpu_cfg(results_dir, "ep_size=1", "backends=[sonicmoe,flashinfer]", "directions=[fwd]",
                               "own_process=[flashinfer]", f"+own_pythonpath.flashinfer={site}"))
    rows = {r.backend: r for r in df.itertuples()}
    fi, sonic = rows["flashinfer"], rows["sonicmoe"]
    assert fi.status == "unsupported" and "Hopper GPU (SM90); this is the CPU" in fi.error
    assert f"{site} first on its path (own_pythonpath)" in fi.notes
    assert sonic.status == "unsupported" and "sonic-moe is not installed" in sonic.error
    assert "processes of its own" not in str(sonic.notes)


def test_an_empty_own_pythonpath_is_no_folder(results_dir):
    """A preset's unset variable gives an empty value: no folder of its own, no error; a folder that is not one is
    still refused."""
    from harness.measure import runner
    from harness.core.errors import ConfigError

    runner.prepare(cpu_cfg(results_dir, "backends=[nccl,flashinfer]", "own_process=[flashinfer]",
                           "+own_pythonpath.flashinfer=''", "+own_pythonpath.sonicmoe=''"))
    with pytest.raises(ConfigError, match="is not a folder"):
        runner.prepare(cpu_cfg(results_dir, "backends=[nccl,flashinfer]", "own_process=[flashinfer]",
                               f"+own_pythonpath.flashinfer={results_dir}/missing"))


# ---- the preset ---------------------------------------------------------------------------------------------------


def _preset(monkeypatch, anchors: str, *overrides: str):
    return compose_cfg("+experiment=hopper_anchors", f"anchors={anchors}", *overrides)


def test_the_preset_composes_two_sets_with_their_own_processes(monkeypatch, tmp_path):
    from harness.config.backend_options import options_for

    from baselines import flashinfer, sonicmoe

    monkeypatch.setenv(flashinfer.SITE_ENV, str(tmp_path / "fi"))  # the variables the adapters' install hints name
    monkeypatch.delenv(sonicmoe.SITE_ENV, raising=False)
    train = _preset(monkeypatch, "training")
    assert list(train.backends) == ["torch", "torch_compiled", "liger", "mok_hopper", "sonicmoe"]
    assert list(train.directions) == ["fwd", "bwd"] and list(train.own_process) == ["sonicmoe"]
    assert train.own_pythonpath.sonicmoe == "" and train.mok_hopper.forward == "save_h"
    monkeypatch.setenv(sonicmoe.SITE_ENV, str(tmp_path / "sonic"))
    assert _preset(monkeypatch, "training").own_pythonpath.sonicmoe == str(tmp_path / "sonic")
    assert "own_pythonpath.sonicmoe=DIR" in sonicmoe.INSTALL_HINT and sonicmoe.SITE_ENV in sonicmoe.INSTALL_HINT
    infer = _preset(monkeypatch, "inference")
    assert list(infer.backends) == ["mok_hopper", "flashinfer"] and list(infer.directions) == ["fwd"]
    assert list(infer.own_process) == ["flashinfer"] and infer.own_pythonpath.flashinfer == str(tmp_path / "fi")
    assert options_for("mok_hopper", dict(infer)).forward == "inference"
    from omegaconf import OmegaConf

    sweep = OmegaConf.load(ROOT / "configs" / "experiment" / "hopper_anchors.yaml").hydra.sweeper.params
    assert dict(sweep) == {"shape": "glm_5_2,qwen3_5_397b", "anchors": "training,inference"}
    for shape in sweep.shape.split(","):  # every point of the sweep composes, as one H100 / H200 runs it
        for anchors in sweep.anchors.split(","):
            cfg = _preset(monkeypatch, anchors, f"shape={shape}")
            assert (cfg.shape.name, cfg.device, cfg.ep_size, cfg.precision.name, cfg.timing.name, cfg.compile,
                    cfg.compile_mode, cfg.calibrate) == (shape, "cuda", 1, "bf16", "published", True, "published",
                                                         True)


@pytest.mark.slow
def test_the_preset_on_the_cpu_gives_unsupported_rows_with_reasons(tmp_path):
    """`python -m harness.run -m +experiment=hopper_anchors` on the CPU (tiny shape, quick timing, torch.compile's
    default mode): both sets of one shape in one run; the PyTorch layers and mok_hopper's CPU twin ok, the GPU
    anchors unsupported with their reason, sonicmoe and flashinfer in processes of their own, flashinfer's with its
    folder first on the path."""
    from harness.core import results

    site = tmp_path / "fi-site"
    site.mkdir()
    out = tmp_path / "res"
    env = dict(os.environ, MOKBENCH_FLASHINFER_SITE=str(site))
    env.pop("MOKBENCH_SONICMOE_SITE", None)
    r = subprocess.run([sys.executable, "-m", "harness.run", "-m", "+experiment=hopper_anchors", "device=cpu",
                        "shape=tiny", "compile=false", "compile_mode=default", "calibrate=false", "timing=quick",
                        "workload.tokens_per_gpu=64", "timing.num_warmup=1", "timing.num_iters=2",
                        "timing.phase_iters=2", f"results_dir={out}", "print_table=false"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    df = results.load(out)
    assert df["run_id"].nunique() == 1
    st = {(x.backend, x.direction, str(x.backend_options)): (x.status, str(x.error), str(x.notes))
          for x in df.itertuples()}
    got = {(b, d) for b, d, _ in st}
    assert got == {(b, d) for b in ("torch", "torch_compiled", "liger", "mok_hopper", "sonicmoe") for d in
                   ("fwd", "bwd")} | {("flashinfer", "fwd")}
    by = {(b, d, "inference" if "forward=inference" in o else ""): v for (b, d, o), v in st.items()}
    for b in ("torch", "torch_compiled"):
        assert by[(b, "fwd", "")][0] == by[(b, "bwd", "")][0] == "ok"
    assert by[("mok_hopper", "fwd", "")][0] == by[("mok_hopper", "fwd", "inference")][0] == "ok"
    assert "Hopper (SM90)" in by[("sonicmoe", "fwd", "")][1] or "not installed" in by[("sonicmoe", "fwd", "")][1]
    assert "processes of its own" in by[("sonicmoe", "fwd", "")][2]
    fi = by[("flashinfer", "fwd", "")]
    assert fi[0] == "unsupported" and "flashinfer-python is not installed" in fi[1]
    assert f"{site} first on its path" in fi[2]
    assert by[("liger", "fwd", "")][0] == "unsupported"


# ---- the bundles of wheels ---------------------------------------------------------------------------------------


def test_pack_keeps_every_bundle_under_the_limit():
    sizes = {"a": 45, "b": 30, "c": 20, "d": 5, "e": 50}
    bundles = W.pack(sizes, 50)
    assert sorted(n for b in bundles for n in b) == sorted(sizes)
    assert all(sum(sizes[n] for n in b) <= 50 for b in bundles) and len(bundles) == 3
    with pytest.raises(ValueError, match="split it"):
        W.pack({"big": 51}, 50)


def _wheel(path: Path, name: str, payload: int) -> Path:
    """A minimal installable wheel: a module, a .pth naming a subfolder, and ``payload`` bytes of data."""
    dist = f"{name}-1.0.dist-info"
    files = {f"{name}/__init__.py": "VALUE = 42\n", f"{name}.pth": f"{name}_extra\n",
             f"{name}_extra/{name}_extra_mod.py": "", f"{name}/blob.bin": os.urandom(payload).hex(),
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{dist}/RECORD,,\n"
    whl = path / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_STORED) as z:
        for n, text in files.items():
            z.writestr(n, text)
    return whl


def test_bundles_carry_split_wheels_and_anchor_sites_installs_them(tmp_path):
    """Wheels larger than a bundle are split, the pieces packed into bundles under the limit; on the other side
    scripts/anchor_sites.sh joins and installs each anchor's wheels into a folder of its own and exports its
    MOKBENCH_<ANCHOR>_SITE, which then holds the package and the folder its .pth names."""
    out = tmp_path / "out"
    (out / "wheels" / "flashinfer").mkdir(parents=True)
    (out / "wheels" / "sonicmoe").mkdir(parents=True)
    big = _wheel(out / "wheels" / "flashinfer", "planted_fi", 300_000)  # about 600 kB as hex
    _wheel(out / "wheels" / "sonicmoe", "planted_sonic", 1000)
    whole = big.read_bytes()
    assert W.main([str(out), "--max-mib", "0.25", "--no-download"]) == 0
    parts = sorted(p for p in out.glob("bundle-*/flashinfer/*"))
    assert len(parts) >= 3 and all(p.name.startswith(big.name + ".part-a") for p in parts)
    assert b"".join(p.read_bytes() for p in sorted(parts, key=lambda p: p.name)) == whole
    assert all(sum(f.stat().st_size for f in b.rglob("*") if f.is_file()) <= 0.25 * W.MIB
               for b in out.glob("bundle-*"))
    sites = {a: tmp_path / f"site-{a}" for a in ("sonicmoe", "flashinfer")}
    script = (f"export MOKBENCH_SONICMOE_SITE={sites['sonicmoe']} MOKBENCH_FLASHINFER_SITE={sites['flashinfer']}; "
              f"source scripts/anchor_sites.sh {out} && echo \"FI=$MOKBENCH_FLASHINFER_SITE PP=${{PYTHONPATH:-}}\"")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert f"FI={sites['flashinfer']} PP=" in r.stdout and r.stdout.rstrip().endswith("PP=")  # this shell's path kept
    fi = sites["flashinfer"]
    assert (fi / "planted_fi" / "__init__.py").is_file() and (fi / "planted_fi.pth").is_file()
    assert (fi / "planted_fi_extra" / "planted_fi_extra_mod.py").is_file()
    assert (sites["sonicmoe"] / "planted_sonic" / "__init__.py").is_file()
    r = subprocess.run(["bash", "-c", f"source scripts/anchor_sites.sh {tmp_path / 'none'} flashinfer"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0 and "no files of flashinfer" in r.stderr


def test_anchor_wheels_refuses_an_unknown_anchor(tmp_path, capsys):
    assert W.main([str(tmp_path), "--anchors", "nope", "--no-download"]) == 2
    assert "unknown anchor nope" in capsys.readouterr().err
