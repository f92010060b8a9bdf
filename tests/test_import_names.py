"""Import names beside the ecosystem's: the project's packages load together with Hugging Face's ``kernels``
distribution (a transformers dependency) in one environment, and where another distribution's ``baselines`` or
``contract`` comes first on the path, the harness's commands say so in one line and exit 2 before anything runs
(harness/core/own_packages.py; docs/backends.md, "Import names")."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("harness.run", "harness.report", "harness.gate", "harness.compare", "harness.core.run_meta",
            "harness.slurm")
PACKAGES = ("contract", "harness", "baselines", "mok_kernels", "mok_tools", "hydra_plugins")


def plant(folder: Path, name: str, dist: str | None = None) -> Path:
    """A package ``name`` in ``folder`` (what another distribution would install), with its dist-info if ``dist``."""
    (folder / name).mkdir(parents=True)
    (folder / name / "__init__.py").write_text("PLANTED = True\n")
    if dist:
        info = folder / f"{dist}-0.1.5.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.5\n")
        (info / "top_level.txt").write_text(f"{name}\n")
    return folder / name


def command(module: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m module --help`` from ``cwd`` (first on sys.path), with this checkout after it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", module, "--help"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("module", COMMANDS)
def test_every_command_refuses_another_distributions_baselines(module, tmp_path):
    """OpenAI's ``baselines`` (import name ``baselines``) earlier on the path: one line naming it and the fix."""
    where = plant(tmp_path, "baselines", dist="baselines")
    p = command(module, tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, p.stdout[-400:], p.stderr[-1200:])
    assert f"`import baselines` loads {where.resolve()} (distribution baselines)" in lines[0], lines[0]
    assert str(ROOT / "baselines") in lines[0] and "`pip uninstall baselines`" in lines[0], lines[0]
    assert not p.stdout


@pytest.mark.parametrize("name", ["contract", "mok_kernels", "mok_tools"])
def test_a_foreign_package_without_a_distribution_is_named_with_its_fix(name, tmp_path):
    where = plant(tmp_path, name)
    p = command("harness.report", tmp_path)
    line = p.stderr.strip()
    assert p.returncode == 2 and f"`import {name}` loads {where.resolve()}, not mokbench's" in line, p.stderr
    assert "run from the mokbench checkout's root or a virtual environment of its own" in line


def test_the_commands_run_where_every_package_is_the_projects(tmp_path):
    """The control: the same call without a planted package runs (the guard is what refuses above)."""
    p = command("harness.report", tmp_path)
    assert p.returncode == 0 and "usage: python -m harness.report" in p.stdout, p.stderr[-800:]


NETWORK = re.compile(r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|"
                     r"Network is unreachable|No matching distribution found|Could not fetch URL|ConnectTimeout|"
                     r"ReadTimeoutError|ProxyError")


@pytest.mark.slow
def test_a_fresh_venv_imports_the_project_beside_hugging_faces_kernels(tmp_path):
    """A fresh virtual environment (the system's site-packages beneath it) with the project installed
    from a copy of its packages (not editable: the installed copy is what imports) and the package index's
    ``kernels``: from a folder that is not the checkout, ``import kernels`` is Hugging Face's and every package of
    the project is the installed one."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in PACKAGES:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    # the project without its dependencies (its build needs setuptools from the index), then HF's kernels with what
    # it imports (huggingface_hub and the rest: small, no torch), which the system's site-packages need not hold;
    # --ignore-installed: into the venv even where the system's site-packages already has it
    for what, deps in ((str(src), ["--no-deps"]), ("kernels", [])):
        p = subprocess.run([py, "-m", "pip", "install", *deps, "--ignore-installed", "-q", what], env=env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=600)
        if p.returncode != 0 and (m := NETWORK.search(p.stdout + p.stderr)):
            pytest.skip(f"the package index is not reachable (pip install {Path(what).name}): {m[0]}")
        assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-1500:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = ("import json, sysconfig, kernels, harness, baselines, contract, mok_kernels, mok_tools\n"
             "from harness.core.own_packages import clash\n"
             "print(json.dumps({'site': sysconfig.get_paths()['purelib'], 'get_kernel': hasattr(kernels, 'get_kernel'),"
             " 'clash': clash(), **{m.__name__: m.__file__ for m in (kernels, harness, baselines, contract, "
             "mok_kernels, mok_tools)}}))")
    p = subprocess.run([py, "-c", probe], env=env, cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    site = Path(out["site"]).resolve()
    assert site.is_relative_to(venv.resolve()), out
    assert out["get_kernel"], f"kernels is not Hugging Face's: {out['kernels']}"
    for name in ("kernels", "harness", "baselines", "contract", "mok_kernels", "mok_tools"):
        assert Path(out[name]).resolve() == site / name / "__init__.py", (name, out[name])
    assert out["clash"] is None, out["clash"]
