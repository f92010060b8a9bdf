"""The two-ref gate (harness.gate): refusals before anything runs, sources exported and removed, each side running
its own code in alternating rounds, and compare's verdict and exit code on the rows.

The gate runs in a temporary git repository made from this checkout's code: commit ``base``, and ``broken``, whose
nccl baseline reports itself unsupported (a deterministic change of status, so the verdicts do not depend on how
loaded the machine is), and ``newopt``, whose config knows one more option, ``gate_probe``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.gate import gate as G
from harness.core import results

ROOT = Path(__file__).resolve().parent.parent
CODE = ("contract", "harness", "baselines", "mok_kernels", "configs", "hydra_plugins", "pyproject.toml")
MARKER = "gate test: this version refuses every point"
# the smallest timed point: nccl alone, forward, 64 tokens a rank, one warmup and two timed iterations, no check
TINY = ["backends=[nccl]", "direction=fwd", "workload.tokens_per_gpu=64", "timing.num_warmup=1", "timing.num_iters=2",
        "timing.phase_iters=0", "check=false"]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=gate-test", "-c", "user.email=gate@test", "-C", str(repo), *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def _copy_code(dest: Path) -> None:
    for name in CODE:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest / name)


def init_repo(repo: Path, message: str) -> None:
    """A git repository at ``repo`` (made here) holding this checkout's code, committed on ``main``."""
    repo.mkdir()
    _copy_code(repo)
    (repo / ".gitignore").write_text("__pycache__/\nresults/local/\noutputs/\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)


def _break(tree: Path) -> None:
    """nccl refuses every point."""
    p = tree / "baselines" / "nccl.py"
    s = p.read_text()
    old = "        why = precision_unsupported(case.precision, torch.device(case.device))\n"
    assert old in s
    p.write_text(s.replace(old, f"        return {MARKER!r}\n" + old, 1))


def _add_option(tree: Path) -> None:
    """The config gains an option (``gate_probe``) that BASE does not know."""
    c = tree / "harness" / "config" / "schema.py"
    s = c.read_text()
    old = "    print_table: bool = True\n"
    assert old in s
    c.write_text(s.replace(old, old + "    gate_probe: int = 0\n", 1))


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> dict:
    """A git repository of this checkout's code: ``base``, ``broken`` and ``newopt`` (the module docstring)."""
    r = tmp_path_factory.mktemp("gate") / "repo"
    init_repo(r, "base")
    _git(r, "tag", "base")
    base = _git(r, "rev-parse", "HEAD")
    _git(r, "checkout", "-q", "-b", "broken")
    _break(r)
    _git(r, "commit", "-q", "-am", "broken")
    broken = _git(r, "rev-parse", "HEAD")
    _git(r, "checkout", "-q", "-b", "newopt", "base")
    _add_option(r)
    _git(r, "commit", "-q", "-am", "an option BASE does not know")
    _git(r, "checkout", "-q", "main")
    return dict(path=r, base=base, broken=broken)


def gate(args: list[str], cwd: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.chdir(cwd)
    code = G.main(args)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("harness.gate: ")
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------
# refusals: one line, exit 2, nothing written (no --out folder, nothing left in --workdir)


REFUSALS = {
    "unknown ref": (["base", "no-such-ref"], "unknown ref 'no-such-ref'"),
    "rounds 0": (["base", "broken", "--rounds", "0"], "--rounds 0: at least 1"),
    "rounds not a number": (["base", "broken", "--rounds", "five"], "--rounds 'five' is not a whole number"),
    "unknown option": (["base", "broken", "--frobnicate"], "unknown option --frobnicate"),
    "bare threshold": (["base", "broken", "--threshold", "5"], "write 5% or 0.05"),
    "threshold 100%": (["base", "broken", "--threshold", "100%"], "out of range"),
    "one ref": (["base"], "give two refs"),
    "refs and dirs": (["base", "broken", "--base-dir", "."], "not both"),
    "base dir alone": (["--base-dir", "."], "go together"),
    "gate's own override": (["base", "broken", "--", "run_id=mine"], "the gate's own"),
    "results_dir override": (["base", "broken", "--", "+results_dir=/x"], "the gate's own"),
    "bad name": (["base", "broken", "--name", "a/b"], "--name 'a/b'"),
    "control without normalize": (["base", "broken", "--control", "nccl"], "--normalize control"),
    "option BASE lacks": (["base", "newopt", "--", "gate_probe=1"], "BASE base"),
    "option neither knows": (["base", "broken", "--", "no_such_option=1"], "refuses these options"),
    "backend neither has": (["base", "broken", "--backend", "bogus"], "has no backend bogus"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_are_one_line_exit_2_and_leave_nothing(repo, tmp_path, monkeypatch, capsys, case):
    args, words = REFUSALS[case]
    wd, out = tmp_path / "wd", tmp_path / "out"
    wd.mkdir()
    code, _, err = gate(_with_dirs(args, out, wd), repo["path"], monkeypatch, capsys)
    assert code == 2
    assert words in one_line(err), err
    assert not out.exists() and list(wd.iterdir()) == []


def _with_dirs(args: list[str], out: Path, wd: Path) -> list[str]:
    """``args`` with --out and --workdir before any ``--`` (the run's overrides)."""
    own = ["--out", str(out), "--workdir", str(wd)]
    if "--" in args:
        i = args.index("--")
        return [*args[:i], *own, *args[i:]]
    return [*args, *own]


def test_outside_a_git_repository_refs_are_refused_and_dirs_named(tmp_path, monkeypatch, capsys):
    code, _, err = gate(["main", "WORKTREE", "--out", str(tmp_path / "out")], tmp_path, monkeypatch, capsys)
    assert code == 2 and "--base-dir DIR --new-dir DIR" in one_line(err)
    assert not (tmp_path / "out").exists()


def test_an_existing_run_name_is_refused(repo, tmp_path, monkeypatch, capsys):
    (tmp_path / "out" / "mine").mkdir(parents=True)
    code, _, err = gate(["base", "broken", "--name", "mine", "--out", str(tmp_path / "out")], repo["path"],
                        monkeypatch, capsys)
    assert code == 2 and "already exists" in one_line(err)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine"]


def test_a_source_folder_that_does_not_hold_its_own_code_is_refused(repo, tmp_path, monkeypatch, capsys):
    """A folder missing a package would run another copy's (an installed checkout's) code: refused before any
    round."""
    partial = tmp_path / "partial"
    shutil.copytree(repo["path"], partial, ignore=shutil.ignore_patterns(".git", "mok_kernels"))
    code, _, err = gate(["--base-dir", str(partial), "--new-dir", str(repo["path"]), "--out", str(tmp_path / "out")],
                        tmp_path, monkeypatch, capsys)
    line = one_line(err)
    assert code == 2 and "mok_kernels" in line and str(partial) in line
    assert not (tmp_path / "out").exists()


def test_worktree_export_holds_uncommitted_and_untracked_files_but_not_ignored_ones(repo, tmp_path):
    r = repo["path"]
    (r / "untracked.txt").write_text("new file\n")
    (r / "results" / "local").mkdir(parents=True)
    (r / "results" / "local" / "ignored.csv").write_text("x\n")
    readme = r / "pyproject.toml"
    before = readme.read_text()
    readme.write_text(before + "# an uncommitted line\n")
    try:
        side = G.Side("NEW", "WORKTREE", sha=repo["base"])
        G.export(side, r, tmp_path / "new")
        assert (tmp_path / "new" / "untracked.txt").read_text() == "new file\n"
        assert (tmp_path / "new" / "pyproject.toml").read_text().endswith("# an uncommitted line\n")
        assert not (tmp_path / "new" / "results" / "local").exists()
        assert not (tmp_path / "new" / ".git").exists() and side.exported
        ref = G.Side("BASE", "broken", sha=repo["broken"])
        G.export(ref, r, tmp_path / "ref")
        assert MARKER in (tmp_path / "ref" / "baselines" / "nccl.py").read_text()
        assert not (tmp_path / "ref" / "untracked.txt").exists()
    finally:
        readme.write_text(before)
        (r / "untracked.txt").unlink()
        shutil.rmtree(r / "results")


def test_run_env_puts_the_side_first_and_names_its_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("MOKBENCH_GIT_SHA", "stale")
    monkeypatch.setenv("MOKBENCH_RUN_ID", "stale")
    env = G.run_env(G.Side("NEW", "WORKTREE", src=tmp_path, sha="abc", dirty=True))
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/elsewhere"]
    assert env["MOKBENCH_GIT_SHA"] == "abc" and env["MOKBENCH_GIT_DIRTY"] and "MOKBENCH_RUN_ID" not in env
    env = G.run_env(G.Side("BASE", "/some/dir", src=tmp_path))
    assert "MOKBENCH_GIT_SHA" not in env and "MOKBENCH_GIT_DIRTY" not in env


def test_help_names_the_threshold_rule_and_the_modes(capsys):
    with pytest.raises(SystemExit):
        G.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "a percentage with % (5%) or a fraction (0.05)" in out
    assert "--base-dir" in out and "WORKTREE" in out and "--rounds" in out


# ---------------------------------------------------------------------------------------------------------------
# whole gates on the CPU (gloo ranks), tiny points


def test_the_judged_backends_join_the_points_backends():
    """--backend (and --control) run beside the backends the points name; overrides already holding them stay."""
    kept = ["direction=fwd", "backends=[nccl,mok_hopper]"]
    assert G.with_judged_backends(kept, [["nccl", "mok_hopper"]] * 2, ["mok_hopper"]) == (kept, None)
    runs, note = G.with_judged_backends(["backend=nccl", "direction=fwd"], [["nccl"], ["nccl"]], ["mok_hopper"])
    assert runs == ["direction=fwd", "backends=[nccl,mok_hopper]"]
    assert note == "the points run backends=[nccl]; added mok_hopper (judged): backends=[nccl,mok_hopper]"
    runs, _ = G.with_judged_backends(["+backends=[nccl]"], [["nccl"], ["nccl", "reference"]], ["mok_hopper", "nccl"])
    assert runs == ["backends=[nccl,reference,mok_hopper]"]
    assert G.with_judged_backends(["backend=nccl"], [None, ["nccl"]], ["mok_hopper"]) == (["backend=nccl"], None)
    opts = {"backends": ["mok_hopper"], "control": "nccl"}
    assert G.judged_backends(opts) == ["mok_hopper", "nccl"]


def _rows(out: Path, side: str) -> "results.pd.DataFrame":
    return results.load(out / side)


@pytest.mark.slow
def test_gate_fails_a_ref_whose_backend_stops_working(repo, tmp_path, monkeypatch, capsys):
    wd, out = tmp_path / "wd", tmp_path / "out"
    wd.mkdir()
    code, stdout, err = gate(["base", "broken", "--rounds", "1", "--name", "g", "--out", str(out), "--workdir",
                              str(wd), "--", *TINY], repo["path"], monkeypatch, capsys)
    assert code == 1, stdout + err
    assert "status change" in stdout and stdout.strip().splitlines()[-1] == \
        "FAIL: regression or status change from ok (exit 1)"
    b, n = _rows(out / "g", "base"), _rows(out / "g", "new")
    assert set(b["run_id"]) == {"g-base-r1"} and set(n["run_id"]) == {"g-new-r1"}
    assert set(b["status"]) == {"ok"} and set(b["git_sha"]) == {repo["base"]}
    # NEW ran its own code (its nccl refuses), not this checkout's or an installed copy's
    assert set(n["status"]) == {"unsupported"} and n["error"].str.contains(MARKER).all()
    assert set(n["git_sha"]) == {repo["broken"]}
    assert (out / "g" / "compare.csv").is_file() and (out / "g" / "new" / "g-new-r1" / "gate.log").is_file()
    assert list(wd.iterdir()) == []  # the exported sources are removed


@pytest.mark.slow
def test_gate_rounds_alternate_and_pair(repo, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    code, stdout, err = gate(["base", "main", "--rounds", "2", "--name", "aa", "--out", str(out), "--", *TINY],
                             repo["path"], monkeypatch, capsys)
    assert code in (0, 1, 3), stdout + err  # an A/A gate: the verdict is the machine's noise
    order = [ln.split(": ", 1)[1].split(" ")[:3] for ln in stdout.splitlines() if ": round " in ln]
    assert order == [["round", "1/2", "BASE"], ["round", "1/2", "NEW"], ["round", "2/2", "NEW"],
                     ["round", "2/2", "BASE"]]
    assert set(_rows(out / "aa", "base")["run_id"]) == {"aa-base-r1", "aa-base-r2"}
    table = results.pd.read_csv(out / "aa" / "compare.csv")
    assert table["paired"].all() and (table["n_base"] == 2).all() and (table["n_new"] == 2).all()
    assert set(table["noise_source"]) <= {"rounds", "other backends"}


@pytest.mark.slow
def test_gate_worktree_is_the_checkout_with_its_uncommitted_changes(repo, tmp_path, monkeypatch, capsys):
    r = repo["path"]
    nccl = r / "baselines" / "nccl.py"
    before = nccl.read_text()
    _break(r)
    try:
        out = tmp_path / "out"
        code, stdout, err = gate(["HEAD", "WORKTREE", "--rounds", "1", "--name", "w", "--out", str(out), "--",
                                  *TINY], r, monkeypatch, capsys)
        assert code == 1, stdout + err
        n = _rows(out / "w", "new")
        assert n["error"].str.contains(MARKER).all() and set(n["git_sha"]) == {repo["base"]}
        assert n["git_dirty"].all() and not _rows(out / "w", "base")["git_dirty"].any()
        assert "uncommitted changes" in stdout
    finally:
        _git(r, "checkout", "--", ".")
    assert nccl.read_text() == before


@pytest.mark.slow
def test_gate_on_two_prepared_folders_without_git(repo, tmp_path, monkeypatch, capsys):
    """The machine-without-.git mode: BASE is the broken tree, NEW the fixed one: fixed, exit 0."""
    broken, fixed = tmp_path / "broken", tmp_path / "fixed"
    for d in (broken, fixed):
        shutil.copytree(repo["path"], d, ignore=shutil.ignore_patterns(".git"))
    _break(broken)
    out = tmp_path / "out"
    code, stdout, err = gate(["--base-dir", str(broken), "--new-dir", str(fixed), "--rounds", "1", "--name", "d",
                              "--out", str(out), "--", *TINY], tmp_path, monkeypatch, capsys)
    assert code == 0, stdout + err
    assert "fixed" in stdout and stdout.strip().splitlines()[-1] == "OK: no regression (exit 0)"
    assert (broken / "baselines").is_dir() and (fixed / "baselines").is_dir()  # given folders are kept
    assert not list(broken.rglob("outputs"))  # Hydra's run folder went to the temporary folder


@pytest.mark.slow
def test_gate_across_options_judges_a_change_of_an_option_default(repo, tmp_path, monkeypatch, capsys):
    """NEW flips nccl's ``fp8_gemm`` default (auto -> emulated; on the CPU auto runs emulated, so the same work): every
    row hashes differently, the plain gate finds nothing to match (exit 2, and says to use --across-options), and
    ``--across-options`` matches the rows and judges them."""
    base, new = tmp_path / "base", tmp_path / "new"
    for d in (base, new):
        shutil.copytree(repo["path"], d, ignore=shutil.ignore_patterns(".git"))
    opts = new / "baselines" / "options.py"
    old = 'fp8_gemm: str = option("auto", choices=FP8_GEMMS, alias="fp8_gemm", hash_precision="fp8", hash_default=True,'
    assert old in opts.read_text()
    opts.write_text(opts.read_text().replace(old, old.replace('option("auto"', 'option("emulated"'), 1))
    point = ["--", *TINY, "precision=fp8"]
    code, stdout, err = gate(["--base-dir", str(base), "--new-dir", str(new), "--rounds", "1", "--name", "plain",
                              "--out", str(tmp_path / "out"), *point], tmp_path, monkeypatch, capsys)
    assert code == 2 and "NO MATCH" in err and "--across-options" in err, stdout + err
    code, stdout, err = gate(["--base-dir", str(base), "--new-dir", str(new), "--rounds", "1", "--name", "across",
                              "--out", str(tmp_path / "out"), "--across-options", *point], tmp_path, monkeypatch,
                             capsys)
    assert code in (0, 3), stdout + err  # the same work on both sides: the CPU's noise decides between the two
    assert "judged as BASE's" in stdout and "nccl: fp8_gemm=auto -> fp8_gemm=emulated" in stdout
    table = results.pd.read_csv(tmp_path / "out" / "across" / "compare.csv")
    assert len(table) == 1 and table["verdict"].iloc[0] in ("unchanged", "inconclusive")
    assert "--across-options" in stdout  # the "again:" command repeats it


def test_gate_module_runs_as_a_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "harness.gate", "main", "main", "--rounds", "0"], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip() == \
        "harness.gate: --rounds 0: at least 1 (one run of each side a round; 5 by default)"
