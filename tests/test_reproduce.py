"""The reproduce commands (docs/reproduce.md, and the README's one-line "reproduce" job), run as dry runs: each one
plans every backend of the published figure (read from results/published/), on every published shape, precision and
direction, at the EP size of its case. No GPU or cluster needed: the dry run validates GPU jobs from this machine and
runs nothing."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from harness.report.claims import load_published
from harness.report.labels import SHAPE_ORDER

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "reproduce.md"
TITLE = "# Reproduce the published comparison"


def _section() -> str:
    text = PAGE.read_text()
    assert text.startswith(TITLE), f"{PAGE} does not start with '{TITLE}'"
    return text[len(TITLE):]


def _cases() -> dict[str, list[list[str]]]:
    """The page's commands, by the bold case heading above their code block."""
    cases: dict[str, list[list[str]]] = {}
    heading = ""
    for part in re.split(r"(```.*?```)", _section(), flags=re.S):
        if part.startswith("```"):
            body = part.strip("`").replace("\\\n", " ")
            for line in body.splitlines():
                if line.strip().startswith("python3 -m harness.run"):
                    cases.setdefault(heading, []).append(shlex.split(line.split("#")[0]))
        else:
            bold = re.findall(r"\*\*(.+?)\*\*", part)
            if bold:
                heading = bold[-1]
    return cases


CASES = _cases()
# case heading on the page -> (EP of each job, contender, precisions, node GPUs to plan with when no Slurm)
EXPECT = {
    "GB300 NVL72, upstream MoK, EP=64": (64, "mok", ("bf16", "mxfp8"), None),
    "One 8-GPU H100 / H200 node": (8, "mok_hopper", ("bf16", "fp8"), 8),
    "2 GPUs": (2, "mok_hopper", ("bf16", "fp8"), 2),
}


def _published_backends() -> set[str]:
    return set(load_published()["backend"])


def test_readme_has_the_three_cases():
    assert set(CASES) == set(EXPECT), sorted(CASES)
    published = load_published()
    assert {"nccl", "deepep", "deepep_te", "hybridep_megatron", "mok"} <= set(published["backend"])
    for heading, cmds in CASES.items():
        dry = [c for c in cmds if "hydra.launcher.dry_run=true" in c]
        real = [c for c in cmds if "hydra.launcher.dry_run=true" not in c]
        assert dry, f"{heading}: no dry run"
        # every dry run is the real command plus the flag, so the dry run plans what the real command runs
        for c in dry:
            assert [a for a in c if a != "hydra.launcher.dry_run=true"] in real, (heading, c)


def test_the_readme_reproduce_job_is_a_command_of_the_page():
    """The README's one-line "reproduce" job is one of the page's real commands, so the dry runs below cover it."""
    readme = (REPO / "README.md").read_text()
    jobs = re.findall(r"^\| reproduce the published comparison \| `([^`]+)` \|", readme, flags=re.M)
    assert len(jobs) == 1, "README.md's job table has no single reproduce command"
    real = [c for cmds in CASES.values() for c in cmds if "hydra.launcher.dry_run=true" not in c]
    assert shlex.split(jobs[0]) in real, (jobs[0], real)


@pytest.mark.slow
@pytest.mark.parametrize("heading", sorted(EXPECT))
def test_readme_reproduce_dry_runs_plan_every_published_backend(tmp_path, heading):
    ep, contender, precisions, node_gpus = EXPECT[heading]
    want = (_published_backends() - {"mok"}) | {contender, "hybridep"}
    dry = [c for c in CASES[heading] if "hydra.launcher.dry_run=true" in c]
    for i, cmd in enumerate(dry):
        args = [a.replace("<partition>", "gpu") for a in cmd[3:]]  # drop "python3 -m harness.run"
        args.append(f"hydra.sweep.dir={tmp_path}/sweep{i}")
        slurm = "+experiment=hopper_published" not in args
        if not slurm:  # this machine's launcher: plan for the case's GPUs (this machine may have none)
            args.append(f"hydra.launcher.gpus_per_node={node_gpus}")
        r = subprocess.run([sys.executable, "-m", "harness.run", *args], cwd=REPO, capture_output=True, text=True,
                           timeout=600)
        out = r.stdout
        assert r.returncode == 0, out + r.stderr
        jobs = re.findall(r"^  #(\d+)\s+(.+?): (\d+) node\(s\) x (\d+) task\(s\), EP (\d+), (\d+) GPUs, cuda.*\n"
                          r"\s+backends: (.+?); directions: (.+)$", out, flags=re.M)
        points = len(SHAPE_ORDER) * len(precisions)
        assert len(jobs) == points, out
        assert f"{points} sweep points -> {points} " + ("slurm jobs" if slurm else "run one after another") in out
        seen = set()
        for _num, label, _nodes, _tasks, job_ep, gpus, backends, directions in jobs:
            assert int(job_ep) == ep and int(gpus) == ep, (heading, label, job_ep, gpus)
            assert set(backends.split(", ")) == want, (heading, label, backends)
            assert directions.split(", ") == ["fwd", "bwd"], (heading, label, directions)
            kv = dict(o.split("=", 1) for o in label.split())
            seen.add((kv["shape"], kv["precision"]))
        assert seen == {(s, p) for s in SHAPE_ORDER for p in precisions}, seen
        assert not (tmp_path / f"sweep{i}" / ".submitit").exists()

