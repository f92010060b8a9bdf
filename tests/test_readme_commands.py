"""Every command of README.md (its fenced code blocks and the job table's commands) runs here, on the CPU at tiny
sizes, and ends as the README says. A command the README gains without a test here fails
:func:`test_every_readme_command_has_a_test`. The set-up and test commands are the ones ``.ci/run`` runs, in order.

Tiny sizes come through documented overrides only: ``harness.run`` keys after the command (docs/configuration.md),
the gate's ``--rounds 1``, ``--out`` and ``--workdir`` and its ``harness.run`` overrides after ``--``
(docs/regression-gate.md), the report's ``--out`` (docs/results.md), the reproduce job's dry run (README.md)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TESTS

from harness.core import results

README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
# the smallest timed CPU point: 64 tokens a rank, one warmup and two timed iterations
TINY = ["workload.tokens_per_gpu=64", "timing.num_warmup=1", "timing.num_iters=2", "timing.phase_iters=0"]
VERDICT = re.compile(r"^(OK|FAIL|INCONCLUSIVE): .*\(exit (\d)\)$")
LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\]\[[\w.]+\]\[[A-Z]+\]")  # Hydra's log format


def readme_commands() -> list[str]:
    """Each line of README.md's fenced code blocks, and each command of its job table, in order."""
    text = README.read_text()
    out = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        out += [ln.strip() for ln in block.splitlines() if ln.strip()]
    out += re.findall(r"^\|[^|\n]+\| `([^`]+)` \|", text, flags=re.M)
    return out


SETUP = ["python3 -m venv .venv && . .venv/bin/activate", 'python3 -m pip install -e ".[test]"',
         "python3 -m pip install --no-deps -r requirements-torchtitan.txt"]
TEST = "python3 -m pytest -q"
DEFAULT = "python3 -m harness.run"
REPRODUCE = "python3 -m harness.run -m +experiment=hopper_published"
GATE = "python3 -m harness.gate main WORKTREE --backend mok_hopper"
REPORT = "python3 -m harness.report results/local"
# each README command -> the test that runs it (the set-up and the suite itself: .ci/run)
TESTED = {SETUP[0]: "test_ci_runs_the_readme_commands", SETUP[1]: "test_ci_runs_the_readme_commands",
          SETUP[2]: "test_ci_runs_the_readme_commands",
          TEST: "test_ci_runs_the_readme_commands", DEFAULT: "test_the_default_run", REPRODUCE:
          "test_the_reproduce_job_dry_run", GATE: "test_the_gate_command", REPORT: "test_the_report_command"}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MOKBENCH_RUN_ID", "MOKBENCH_GIT_SHA")}
    return dict(env, PYTHONPATH=f"{TESTS}{os.pathsep}{ROOT}")


def _run(cmd: str, extra: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    argv = shlex.split(cmd)
    assert argv[0] == "python3"
    return subprocess.run([sys.executable, *argv[1:], *extra], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_every_readme_command_has_a_test():
    cmds = readme_commands()
    assert cmds, "no commands found in README.md"
    assert sorted(set(cmds)) == sorted(TESTED), "README.md's commands and this file's tests differ"
    assert all(name in globals() for name in TESTED.values())


def test_ci_runs_the_readme_commands():
    """``.ci/run`` runs the README's set-up block (the venv, the install, the default run) and its test command, as
    written and in that order: CI is the test of the set-up and of the whole suite."""
    ci = [ln.strip() for ln in CI.read_text().splitlines()]
    wanted = [*SETUP, DEFAULT, TEST]
    at = [ci.index(c) if c in ci else -1 for c in wanted]
    assert -1 not in at and at == sorted(at), dict(zip(wanted, at))
    blocks = [c for c in readme_commands() if c in wanted]
    assert blocks == wanted, blocks


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """``python3 -m harness.run`` in a folder of its own (so its default results_dir, results/local, is there)."""
    cwd = tmp_path_factory.mktemp("readme-run")
    return _run(DEFAULT, TINY, cwd), cwd


@pytest.mark.slow
def test_the_default_run(default_run):
    """Exit 0; the last line names the folder the rows went to and the report command; no log lines on stdout."""
    p, cwd = default_run
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    last = p.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"mokbench: \d+ rows \(.+\) in (results/local/\S+); report: python -m harness\.report \1 "
                     r"--out results/local/reports/\S+", last)
    assert m, last
    assert len(results.load(cwd / m.group(1)))
    assert not [ln for ln in p.stdout.splitlines() if LOG_LINE.match(ln) or "FakeTensor" in ln], p.stdout[-2000:]


@pytest.mark.slow
def test_the_report_command(default_run, tmp_path):
    """``harness.report results/local`` on the default run's rows: exit 0, a report (into --out, not the checkout)."""
    _, cwd = default_run
    p = _run(REPORT, ["--out", str(tmp_path / "report")], cwd)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert (tmp_path / "report" / "claims.md").is_file(), sorted(os.listdir(tmp_path / "report"))


@pytest.mark.slow
def test_the_reproduce_job_dry_run(tmp_path):
    """The reproduce job with ``hydra.launcher.dry_run=true`` (as the README says, first), planned for 8 GPUs from
    this machine: exit 0, every point planned, nothing run."""
    p = _run(REPRODUCE, ["hydra.launcher.dry_run=true", "hydra.launcher.gpus_per_node=8",
                         f"hydra.sweep.dir={tmp_path}/sweep", f"results_dir={tmp_path}/results"], ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert re.search(r"\d+ sweep points -> \d+ run one after another", p.stdout), p.stdout[-2000:]
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_the_gate_command(tmp_path):
    """The gate as written (``main WORKTREE --backend mok_hopper``, no backends given) in a repository of this code,
    one round at the tiny size: it runs mok_hopper beside the default nccl and ends in a verdict table, never
    NO MATCH."""
    from test_gate import init_repo

    repo = tmp_path / "repo"
    init_repo(repo, "main")
    wd = tmp_path / "wd"
    wd.mkdir()
    p = _run(GATE, ["--rounds", "1", "--name", "readme", "--out", str(tmp_path / "out"), "--workdir", str(wd), "--",
                    "direction=fwd", "check=false", *TINY], repo)
    lines = p.stdout.strip().splitlines()
    assert p.returncode in (0, 1, 3), p.stdout[-3000:] + p.stderr[-3000:]
    assert "NO MATCH" not in p.stdout + p.stderr
    assert "harness.gate: the points run backends=[nccl]; added mok_hopper (judged)" in p.stdout, p.stdout[-3000:]
    m = VERDICT.match(lines[-1])
    assert m and int(m.group(2)) == p.returncode, lines[-1]
    table = results.pd.read_csv(tmp_path / "out" / "readme" / "compare.csv")
    assert set(table["backend"]) == {"mok_hopper"} and len(table) == 1, table
