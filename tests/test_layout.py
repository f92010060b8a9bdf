"""The product apart from its journal: a short README whose links resolve, docs that describe the code rather than
its history, and a journal folder (``lab/``) whose code (its run scripts and probes) no package imports and no
product file tells you to run."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("contract", "harness", "baselines", "mok_kernels", "mok_tools", "hydra_plugins")
# Team history: "session 29", "issue 23", "call #4", "call B". Upstream references are written "<project> #N".
HISTORY_WORDS = re.compile(r"\b(session|issue|call)\s*#?\d+|\bcall [A-G]\b", re.IGNORECASE)
# where history belongs: the journal, the measured rows (run ids, logs), and the tests (which may name what they
# guard against)
HISTORY_ALLOWED = ("lab/", "results/runs/", "tests/")


def tracked_files() -> list[str]:
    """The repository's files as a clean checkout has them (git's index, or a walk where there is no .git)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        files = [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "results/local", "__pycache__"}
        files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file()
                 and not any(part in skip for part in p.relative_to(ROOT).parts)]
    return [f for f in files if (ROOT / f).is_file()]


def text_of(rel: str) -> str | None:
    data = (ROOT / rel).read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def history_hits(files: list[str]) -> list[str]:
    hits = []
    for rel in files:
        if rel.startswith(HISTORY_ALLOWED):
            continue
        text = text_of(rel)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if m := HISTORY_WORDS.search(line):
                hits.append(f"{rel}:{n}: {m.group(0)!r} in {line.strip()[:100]}")
    return hits


def test_the_product_describes_the_code_not_its_history():
    hits = history_hits(tracked_files())
    assert not hits, ("team history outside lab/ (write what is true of the code, or move the story into the "
                      "journal):\n" + "\n".join(hits[:40]) + (f"\n... {len(hits) - 40} more" if len(hits) > 40 else ""))


@pytest.mark.parametrize("line,hit", [
    ("added in session 29", True), ("see Issue #23", True), ("call 8 lost the rows", True), ("call B", True),
    ("Session12", True), ("DeepGEMM #365", False), ("run mok_hopper-bf16-fwd_h200x1_20261204-2", False),
    ("one call per point", False),
    ("a call between ranks", False), ("the issue is the clock", False), ("call backward()", False),
])
def test_the_history_pattern_finds_what_it_should(line, hit):
    assert bool(HISTORY_WORDS.search(line)) is hit


def test_the_history_check_reads_the_files_it_should(tmp_path, monkeypatch):
    """A planted history word is found in product files and ignored in the journal, the rows and the tests."""
    files = {"harness/x.py": "# fixed in session 4\n", "docs/y.md": "call C showed it\n",
             "lab/z.md": "session 4\n", "results/runs/r/log.txt": "call B\n", "tests/t.py": "# issue 7\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    hits = history_hits(sorted(files))
    assert [h.split(":")[0] for h in hits] == ["docs/y.md", "harness/x.py"]


# The journal's numbering of runs and machines: a run id with a session number (``<gpu>x<n>-s<NN>...``; runs are
# named ``<what>_<hardware>_<yyyymmdd>``, results/runs/names.csv names the older ones) and the word for a spell on a
# rented machine (say "the same run (same machine allocation, code and baseline builds)"). The measured rows keep
# their run ids as folder names; lab/ cites its own folders (``lab/diagnostics/<date>-s<NN>/``), which are no run ids.
NUMBERING = re.compile(r"(?<![a-z0-9./-])[a-z]{1,2}\d{2,4}x\d+-s\d{2}(?!\d)|\b" + "le" + "ase", re.IGNORECASE)
NUMBERING_ALLOWED = ("lab/", "results/runs/")


def numbering_hits(files: list[str]) -> list[str]:
    hits = []
    for rel in files:
        text = None if rel.startswith(NUMBERING_ALLOWED) else text_of(rel)
        for n, line in enumerate((text or "").splitlines(), 1):
            if m := NUMBERING.search(line):
                hits.append(f"{rel}:{n}: {m.group(0)!r} in {line.strip()[:100]}")
    return hits + [f"{rel}: in the file name" for rel in files
                   if not rel.startswith(NUMBERING_ALLOWED) and NUMBERING.search(Path(rel).name)]


def test_the_product_names_runs_by_what_where_and_when():
    hits = numbering_hits(tracked_files())
    assert not hits, ("the journal's numbering of runs outside lab/ and results/runs/ (name a run by its display "
                      "name, results/runs/names.csv; say 'run' or 'machine allocation'):\n" + "\n".join(hits[:40])
                      + (f"\n... {len(hits) - 40} more" if len(hits) > 40 else ""))


OLD_RUN = "h200x1" + "-s27-v17-fp8"  # built here so that this file holds no such id itself
RENTED = "le" + "ase"


@pytest.mark.parametrize("line,hit", [
    (f"run {OLD_RUN}", True), (f"`{OLD_RUN}-{RENTED}2`", True), (f"results/runs/*-{RENTED}2", True),
    (f"runs on different {RENTED}s", True), (f"a {RENTED.capitalize()} ends", True), (f"h100x1{OLD_RUN[6:]}", True),
    ("run mok_hopper-fp8-fwd_h200x1_20261204-2", False), ("lab/diagnostics/2026-12-04-s29/", False),
    ("the release notes", False), ("please rerun", False), ("--sweep-rounds 4", False), ("fp8-s128 blocks", False),
    ("h200x1-s2 of two", False), ("x1-s270", False),
])
def test_the_numbering_pattern_finds_what_it_should(line, hit):
    assert bool(NUMBERING.search(line)) is hit


def test_the_numbering_check_reads_the_files_it_should(tmp_path, monkeypatch):
    """A planted run id or rented-machine word is found in product files, tests and file names, and ignored in the
    journal and the rows."""
    files = {"harness/x.py": f"# see {OLD_RUN}\n", "docs/y.md": f"one {RENTED} only\n", "tests/t.py": f"# {OLD_RUN}\n",
             f"results/figures/panels_{OLD_RUN}.png": "", f"lab/{OLD_RUN}.md": f"{RENTED}\n",
             f"results/runs/{OLD_RUN}/log.txt": f"{RENTED}\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    hits = numbering_hits(sorted(files))
    assert sorted(h.split(":")[0] for h in hits) == ["docs/y.md", "harness/x.py",
                                                     f"results/figures/panels_{OLD_RUN}.png", "tests/t.py"]


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the details belong in docs/"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                       for p in (ROOT / "docs").glob("*.md")),
                                  "results/README.md", "lab/README.md", "mok_kernels/mok_hopper/README.md"])
def test_every_relative_link_resolves(page):
    text = (ROOT / page).read_text()
    broken = [t for t in LINK.findall(text) if "://" not in t and not (ROOT / page).parent.joinpath(t).exists()]
    assert not broken, f"{page} links to missing files: {broken}"


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
    assert not missing, f"README.md does not link docs pages {missing}"


# the journal's folders that may hold Python: the one-machine run scripts and the one-off probes that made its runs
LAB_CODE = ("lab/scripts/", "lab/probes/")
# a command that runs a file of the journal: python / bash / source / torchrun ... lab/<path>.py|.sh, or -m lab.<mod>
RUNS_LAB = re.compile(r"\b(python3?|bash|sh|source|torchrun)\b[^`|]*?(?<![\w/.])lab/[\w./-]+\.(py|sh)\b|-m\s+lab\.\w")
# where such a line may stand: the journal itself, the measured rows and their logs, the tests
RUN_LAB_ALLOWED = ("lab/", "results/runs/", "tests/")


def test_only_the_journals_scripts_and_probes_folders_hold_python():
    stray = [p.relative_to(ROOT).as_posix() for p in (ROOT / "lab").rglob("*.py")]
    stray = [p for p in stray if not p.startswith(LAB_CODE) and "__pycache__" not in p]
    assert not stray, f"lab/ holds the journal; its code goes into {' or '.join(LAB_CODE)}: {stray}"


def lab_run_hits(files: list[str]) -> list[str]:
    hits = []
    for rel in files:
        if rel.startswith(RUN_LAB_ALLOWED):
            continue
        text = text_of(rel)
        if text is None:
            continue
        hits += [f"{rel}:{n}: {line.strip()[:100]}" for n, line in enumerate(text.splitlines(), 1)
                 if RUNS_LAB.search(line)]
    return hits


def test_no_product_file_tells_you_to_run_the_journals_code():
    """README, docs, configs, scripts and the packages run product commands: what lab/ holds is history."""
    hits = lab_run_hits(tracked_files())
    assert not hits, "a product file runs a file of lab/ (move it into the product, or drop the line):\n" + \
        "\n".join(hits[:40])


@pytest.mark.parametrize("line,hit", [
    ("bash lab/scripts/h200_anchors_run.sh OUTDIR", True), ("python3 lab/probes/wgrad_store_probe.py --aot", True),
    ("source lab/scripts/x.sh", True), ("torchrun --nproc-per-node=2 lab/probes/hybridep_probe.py plain", True),
    ("python -m lab.probes.x", True), ("bash scripts/gpu_env.sh .whl", False), ("see lab/perf-notes.md", False),
    ("the journal's probe (`lab/scripts/fp8_grad_errors.py`) ran out of memory", False),
    ("python3 -m harness.report results/runs  # lab/runs.md has the story", False),
])
def test_the_lab_run_pattern_finds_what_it_should(line, hit):
    assert bool(RUNS_LAB.search(line)) is hit


def test_the_lab_run_check_reads_the_files_it_should(tmp_path, monkeypatch):
    """A planted command that runs a journal script is found in product files and ignored in the journal and tests."""
    files = {"docs/y.md": "bash lab/scripts/run.sh OUT\n", "scripts/z.sh": "python3 lab/probes/p.py\n",
             "lab/x.md": "bash lab/scripts/run.sh OUT\n", "tests/t.py": "# python3 lab/probes/p.py\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert [h.split(":")[0] for h in lab_run_hits(sorted(files))] == ["docs/y.md", "scripts/z.sh"]


def test_no_package_imports_the_journal():
    bad = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                         else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "lab"]
    assert not bad, bad


MAX_LINE = 120  # the project's Python keeps its lines within this many characters


def long_lines(files: list[str]) -> list[str]:
    hits = []
    for rel in files:
        text = text_of(rel) if rel.endswith(".py") else None
        hits += [f"{rel}:{n}: {len(line)} characters" for n, line in enumerate((text or "").splitlines(), 1)
                 if len(line) > MAX_LINE]
    return hits


def test_python_lines_are_at_most_120_characters():
    hits = long_lines(tracked_files())
    assert not hits, (f"lines over {MAX_LINE} characters (wrap them: prose re-flowed, code split at a natural point, "
                      "a string by implicit concatenation):\n" + "\n".join(hits[:40])
                      + (f"\n... {len(hits) - 40} more" if len(hits) > 40 else ""))


def test_the_line_length_check_reads_the_files_it_should(tmp_path, monkeypatch):
    """A planted long line is found in any Python file, lab/ and tests/ included, with its file and line; a line of
    exactly 120 characters and long lines of other files pass."""
    files = {"harness/x.py": "ok\n" + "x" * 121 + "\n", "lab/scripts/y.py": "# " + "y" * 119 + "\n",
             "tests/t.py": "z" * 120 + "\n", "docs/d.md": "w" * 200 + "\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert long_lines(sorted(files)) == ["harness/x.py:2: 121 characters", "lab/scripts/y.py:1: 121 characters"]
