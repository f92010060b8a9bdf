"""Gate a change the way ``asv continuous`` does: two versions of the code, one machine, interleaved rounds, one
verdict.

    python -m harness.gate main WORKTREE --backend mok_hopper          # main against this checkout, uncommitted too
    python -m harness.gate main my-branch --rounds 8 --backend mok_hopper -- shape=glm_5_2 precision=fp8
    python -m harness.gate --base-dir /src/base --new-dir /src/new --backend mok_hopper    # a machine without .git

Each ref (``WORKTREE`` or ``.``: the current checkout with its uncommitted and untracked, not ignored, files) is
exported into a folder of its own under a temporary folder (``--workdir``), removed afterwards; ``--base-dir`` /
``--new-dir`` name two prepared source folders instead. Both run the same ``harness.run`` point(s) on this machine
in ``--rounds`` interleaved rounds, the order alternating (BASE NEW, NEW BASE, ...) so that a machine that drifts
over the gate slows both sides alike. Every run is its own process, with its side's folder first on
``PYTHONPATH`` and as its working directory (checked before the first round: ``harness`` must import from that
folder, not from an installed checkout), and writes its rows to ``<out>/<name>/<side>/<name>-<side>-r<k>/``.
The rows then go to :func:`harness.gate.compare.compare`, paired by round; it prints the table and the one verdict
line, and the exit code is compare's: 0 no regression, 1 regression or a status change from ok (or NEW's
``harness.run`` failed where BASE's ran), 2 bad arguments or nothing to judge, 3 inconclusive.

Overrides after ``--`` go to both sides' ``harness.run`` unchanged; the gate adds only ``run_id``, ``results_dir``
and ``hydra.run.dir`` / ``hydra.sweep.dir``, which every version of ``harness.run`` takes, and checks before the
first round that each side's ``harness.run`` composes them (``--cfg job``): an option that one side does not
know stops the gate with one line, exit 2. The points run every ``--backend`` (and the ``--control``) the gate
judges: where the composed ``backends`` of either side lack one, the gate runs ``backends=[<theirs>, <judged>]``
instead of the ``backend=`` / ``backends=`` overrides given, and says so; a backend a side does not have stops the
gate before any round, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Optional, Sequence

import yaml

from harness.gate import compare as C
from harness.gate.across import match_across_options
from harness.core.tool_args import ArgumentParser
from harness.core import results

DEFAULT_ROUNDS = 5  # docs/regression-gate.md: the interval's width against the rounds, and the measured noise
WORKTREE = ("WORKTREE", ".")
GATE_SET = ("run_id", "results_dir", "hydra.run.dir", "hydra.sweep.dir")  # the overrides the gate writes itself
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
IMPORT_CHECK = ("import importlib.util, json; print(json.dumps({n: (importlib.util.find_spec(n).origin or '') "
                "for n in ('harness', 'harness.run', 'contract', '%s', 'baselines')}))")
BACKENDS_CHECK = "import json; from harness.core.backends import BACKENDS; print(json.dumps(sorted(BACKENDS)))"


class GateError(Exception):
    """A bad input or a side that cannot run: one line for stderr, exit 2."""


class _Parser(ArgumentParser):
    """The tools' one-line argument errors (``harness.core.tool_args``), raised as a :class:`GateError` so that the gate
    leaves nothing behind before it says so and exits 2."""

    def error(self, message: str) -> NoReturn:
        raise GateError(self.explain(message))


@dataclass
class Side:
    """One version of the code: what the user named, the folder it runs from, the commit its rows record."""

    label: str  # BASE / NEW
    spec: str  # the ref, WORKTREE, or the folder given
    src: Optional[Path] = None  # the folder harness.run runs from
    sha: Optional[str] = None  # the commit (MOKBENCH_GIT_SHA); None: the folder's own git, if any
    dirty: bool = False  # WORKTREE with uncommitted changes to tracked files
    exported: bool = False  # src is a folder the gate made (removed afterwards)

    @property
    def key(self) -> str:
        return self.label.lower()

    def describe(self) -> str:
        short = f" ({self.sha[:10]}{', uncommitted changes' if self.dirty else ''})" if self.sha else ""
        return f"{self.label} {self.spec}{short}"


def _git(repo: Path, *args: str, check: bool = True) -> Optional[str]:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if out.returncode != 0:
        if check:
            raise GateError(f"git {' '.join(args)} failed in {repo}: {(out.stderr.strip() or '?').splitlines()[0]}")
        return None
    return out.stdout.strip()


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The gate's options and the ``harness.run`` overrides after ``--``."""
    argv = list(argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = _Parser(
        prog="python -m harness.gate", description=__doc__.split("\n\n")[0],
        epilog="exit codes: 0 no regression; 1 regression, status change from ok, or NEW's harness.run failed; "
               "2 bad arguments or nothing to judge; 3 inconclusive (too noisy to decide, no regression)")
    ap.add_argument("base_ref", nargs="?", help="BASE: a git ref of the repository holding the current directory, "
                                                "or WORKTREE / . (this checkout as it is)")
    ap.add_argument("new_ref", nargs="?", help="NEW: a git ref, or WORKTREE / . (this checkout as it is)")
    ap.add_argument("--base-dir", metavar="DIR", help="BASE as a prepared source folder (instead of refs; no .git "
                                                      "needed)")
    ap.add_argument("--new-dir", metavar="DIR", help="NEW as a prepared source folder (with --base-dir)")
    ap.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                    help=f"interleaved rounds, one run of each side a round (default {DEFAULT_ROUNDS})")
    ap.add_argument("--backend", "-b", action="append", default=[], metavar="NAME",
                    help="judge only this backend's rows (repeat or comma-separate); it runs beside the points' "
                         "backends; default: all")
    ap.add_argument("--threshold", default="5%", metavar="T",
                    help=f"smallest change that matters (default 5%%): {C.THRESHOLD_RULE}")
    ap.add_argument("--confidence", default="95%", metavar="C", help="the change's interval (default 95%%)")
    ap.add_argument("--normalize", choices=C.NORMALIZE, default="none", help="as harness.compare --normalize")
    ap.add_argument("--control", metavar="NAME", help="the unchanged backend for --normalize control")
    ap.add_argument("--across-options", action="store_true", help=C.ACROSS_HELP)
    ap.add_argument("--name", help="names the runs <name>-<side>-r<k> (default: gate-<UTC time>)")
    ap.add_argument("--out", default="results/local", help="results folder: rows go to <out>/<name>/base and "
                                                            "<out>/<name>/new (default results/local)")
    ap.add_argument("--workdir", metavar="DIR", help="an existing folder for the exported sources (default: the "
                                                     "system's temporary folder); removed from it afterwards")
    ap.add_argument("--python", default=sys.executable, help="the interpreter the runs use (default: this one)")
    ap.add_argument("--run-timeout", type=float, default=None, metavar="S",
                    help="seconds one harness.run may take before the gate stops (default: no limit)")
    return ap.parse_args(own), overrides


def validate(a: argparse.Namespace, overrides: Sequence[str]) -> tuple[Side, Side, dict]:
    """Everything that can be checked before anything is written; raises GateError naming the fix."""
    if a.rounds < 1:
        raise GateError(f"--rounds {a.rounds}: at least 1 (one run of each side a round; "
                        f"{DEFAULT_ROUNDS} by default)")
    try:
        opts = dict(min_change=C.parse_fraction(a.threshold, "--threshold"),
                    confidence=C.parse_fraction(a.confidence, "--confidence", low_open=True),
                    normalize=a.normalize, control=a.control,
                    backends=[x.strip() for b in a.backend for x in b.split(",") if x.strip()])
        C.check_options(opts["min_change"], 1.0, opts["normalize"], opts["control"], opts["confidence"])
    except ValueError as e:
        raise GateError(str(e)) from None
    for o in overrides:
        k = o.lstrip("+~").split("=", 1)[0]
        if k in GATE_SET:
            raise GateError(f"the override {o!r} is the gate's own: it sets {', '.join(GATE_SET)} for every run "
                            "(use --out / --name for where the rows go)")
    a.name = a.name or "gate-" + time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    if not NAME.match(a.name):
        raise GateError(f"--name {a.name!r}: letters, digits, '.', '_' and '-' only (it names run ids)")
    if (Path(a.out) / a.name).exists():
        raise GateError(f"{Path(a.out) / a.name} already exists: choose another --name or --out")
    if a.workdir and not Path(a.workdir).is_dir():
        raise GateError(f"--workdir {a.workdir}: not an existing folder")
    if shutil.which(a.python) is None and not Path(a.python).is_file():
        raise GateError(f"--python {a.python}: no such interpreter")
    dirs, refs = (a.base_dir, a.new_dir), (a.base_ref, a.new_ref)
    if any(dirs):
        if any(refs):
            raise GateError("give either two refs or --base-dir and --new-dir, not both")
        if not all(dirs):
            raise GateError("--base-dir and --new-dir go together: give both prepared source folders")
        sides = []
        for label, d in zip(("BASE", "NEW"), dirs):
            p = Path(d).resolve()
            if not (p / "harness" / "run.py").is_file():
                raise GateError(f"--{label.lower()}-dir {d}: not a mokbench source folder (no harness/run.py)")
            sides.append(Side(label, d, src=p))
        return sides[0], sides[1], opts
    if not all(refs):
        raise GateError("give two refs (BASE_REF NEW_REF; WORKTREE or . is this checkout), or --base-dir DIR "
                        "--new-dir DIR")
    repo = _git(Path.cwd(), "rev-parse", "--show-toplevel", check=False)
    if repo is None:
        raise GateError(f"{Path.cwd()} is not in a git repository: run from a checkout, or give two prepared "
                        "source folders with --base-dir DIR --new-dir DIR")
    a.repo = Path(repo)
    sides = []
    for label, ref in zip(("BASE", "NEW"), refs):
        if ref in WORKTREE:
            head = _git(a.repo, "rev-parse", "--verify", "--quiet", "HEAD^{commit}", check=False)
            dirty = bool(_git(a.repo, "status", "--porcelain", "--untracked-files=no", check=False))
            sides.append(Side(label, "WORKTREE", sha=head, dirty=dirty))
            continue
        sha = _git(a.repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
        if not sha:
            raise GateError(f"unknown ref {ref!r} in {a.repo} (a branch, tag or commit; WORKTREE or . for this "
                            "checkout as it is)")
        sides.append(Side(label, ref, sha=sha))
    return sides[0], sides[1], opts


def export(side: Side, repo: Path, dest: Path) -> None:
    """Put the side's files in ``dest``: ``git archive`` of its commit (the repository is only read), or for
    WORKTREE a copy of the tracked and untracked, not ignored, files as they are now."""
    dest.mkdir(parents=True)
    if side.spec == "WORKTREE":
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True)
        for rel in sorted({f for f in out.stdout.decode().split("\0") if f}):
            s, d = repo / rel, dest / rel
            if not (s.is_file() or s.is_symlink()):
                continue  # deleted in the checkout, or a submodule folder
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, d, follow_symlinks=False)
    else:
        arch = subprocess.Popen(["git", "-C", str(repo), "archive", "--format=tar", side.sha], stdout=subprocess.PIPE)
        tar = subprocess.run(["tar", "-x", "-C", str(dest)], stdin=arch.stdout, capture_output=True)
        arch.stdout.close()
        if arch.wait() != 0 or tar.returncode != 0:
            raise GateError(f"could not export {side.describe()}: {tar.stderr.decode().strip()[:200]}")
    side.src, side.exported = dest, True


def run_env(side: Side) -> dict[str, str]:
    """The environment of one side's runs: its folder first on PYTHONPATH, the commit its rows record."""
    env = dict(os.environ)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(side.src), *rest])
    env.pop("MOKBENCH_GIT_SHA", None)
    env.pop("MOKBENCH_GIT_DIRTY", None)
    env.pop("MOKBENCH_RUN_ID", None)  # the gate names every run
    if side.sha:
        env["MOKBENCH_GIT_SHA"] = side.sha
        if side.dirty:
            env["MOKBENCH_GIT_DIRTY"] = "uncommitted changes (harness.gate WORKTREE)"
    return env


def check_side(side: Side, python: str, args: list[str]) -> Optional[list[str]]:
    """Before any round: the side imports its own code, and its harness.run composes the run's options. Returns
    the ``backends`` the side's points run (None where its composed configuration does not say)."""
    env = run_env(side)
    # the kernels' package: mok_kernels, or kernels in a tree from before its rename (a base ref may be that old)
    old_layout = (side.src / "kernels").is_dir() and not (side.src / "mok_kernels").is_dir()
    kernels = "kernels" if old_layout else "mok_kernels"
    out = subprocess.run([python, "-c", IMPORT_CHECK % kernels], cwd=side.src, env=env, capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise GateError(f"{side.describe()}: python cannot import it: {_last_line(out.stderr)}")
    src = side.src.resolve()
    for mod, origin in json.loads(out.stdout.strip().splitlines()[-1]).items():
        if not origin or src not in Path(origin).resolve().parents:
            raise GateError(f"{side.describe()}: {mod} imports from {origin or 'nowhere'}, not from {src} (an "
                            "installed copy comes first on sys.path: check PYTHONPATH and .pth files)")
    out = subprocess.run([python, "-m", "harness.run", *args, "--cfg", "job"], cwd=side.src, env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise GateError(f"{side.describe()}: its harness.run refuses these options: {_last_line(out.stderr)}")
    try:
        composed = yaml.safe_load(out.stdout) or {}
    except yaml.YAMLError:
        composed = {}
    backends = composed.get("backends") if isinstance(composed, dict) else None
    return [str(b) for b in backends] if isinstance(backends, list) else None


def side_backends(side: Side, python: str) -> Optional[list[str]]:
    """The backend keys the side's code knows (None where it cannot say: an older layout)."""
    out = subprocess.run([python, "-c", BACKENDS_CHECK], cwd=side.src, env=run_env(side), capture_output=True,
                         text=True)
    try:
        return list(json.loads(out.stdout.strip().splitlines()[-1])) if out.returncode == 0 else None
    except (ValueError, IndexError):
        return None


def judged_backends(opts: dict) -> list[str]:
    """The backends the gate judges: every ``--backend``, and the ``--control`` of ``--normalize control``."""
    return list(dict.fromkeys([*opts["backends"], *([opts["control"]] if opts.get("control") else [])]))


def with_judged_backends(overrides: Sequence[str], composed: Sequence[Optional[Sequence[str]]],
                         judged: Sequence[str]) -> tuple[list[str], Optional[str]]:
    """The overrides the runs get: ``overrides`` as given where every side's points (``composed``: each side's
    ``backends``) run every judged backend, or where a side's are unknown (None); else the ``backend=`` /
    ``backends=`` overrides replaced by ``backends=[<the sides' backends>, <the judged ones they lack>]``, with a
    line saying so."""
    if any(c is None for c in composed) or all(j in c for c in composed for j in judged):
        return list(overrides), None
    have = list(dict.fromkeys(b for c in composed for b in c))
    backends = have + [j for j in judged if j not in have]
    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in ("backend", "backends")]
    added = [j for j in judged if not all(j in c for c in composed)]
    note = (f"the points run backends=[{', '.join(have)}]; added {', '.join(added)} (judged): "
            f"backends=[{','.join(backends)}]")
    return [*kept, f"backends=[{','.join(backends)}]"], note


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no message)"


def run_args(overrides: Sequence[str], run_id: str, results_dir: Path, hydra_dir: Path) -> list[str]:
    return [*overrides, f"run_id={run_id}", f"results_dir={results_dir}", f"hydra.run.dir={hydra_dir}",
            f"hydra.sweep.dir={hydra_dir}"]


def gate(a: argparse.Namespace, overrides: Sequence[str], base: Side, new: Side, opts: dict) -> int:
    out = (Path(a.out) / a.name).resolve()
    tmp = Path(tempfile.mkdtemp(prefix=f"{a.name}-", dir=a.workdir))
    try:
        composed = []
        judged = judged_backends(opts)
        for side in (base, new):  # nothing is written to --out before both sides pass their checks
            if side.src is None:
                export(side, a.repo, tmp / side.key)
            print(f"harness.gate: {side.describe()}: {side.src}", flush=True)
            composed.append(check_side(side, a.python, run_args(overrides, f"{a.name}-check", tmp / "check",
                                                                tmp / "hydra-check")))
            known = side_backends(side, a.python) if judged else None
            if known is not None and (lacks := [j for j in judged if j not in known]):
                raise GateError(f"{side.describe()} has no backend {', '.join(lacks)} (its backends: "
                                f"{', '.join(known)}): name one both sides have in --backend / --control")
        overrides, note = with_judged_backends(overrides, composed, judged)
        if note:
            print(f"harness.gate: {note}", flush=True)
        for k in range(1, a.rounds + 1):
            for side in ((base, new) if k % 2 else (new, base)):
                rid = f"{a.name}-{side.key}-r{k}"
                code = one_run(a, side, rid, run_args(overrides, rid, out / side.key, tmp / "hydra" / rid),
                               out / side.key / rid, f"round {k}/{a.rounds}")
                if code is not None:
                    return code
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    b, n = results.load(out / "base"), results.load(out / "new")
    if a.across_options:
        try:
            b, n, _, lines = match_across_options(b, n)
        except ValueError as e:
            print(f"harness.gate: {e}", file=sys.stderr)
            return C.EXIT_USAGE
        for line in lines:
            print(f"harness.gate: {line}")
    table = C.compare(b, n, **opts)
    if C.matched(table) == 0:
        print(f"harness.gate: {C.no_match_line(b, n, opts['backends'])}", file=sys.stderr)
        return C.EXIT_USAGE
    table.to_csv(out / "compare.csv", index=False)
    print(f"rows: {out}/base and {out}/new; table: {out / 'compare.csv'}; again: python -m harness.compare "
          f"{out}/base {out}/new" + "".join(f" --backend {x}" for x in opts["backends"])
          + (" --across-options" if a.across_options else ""))
    print(C.format_table(table, show_all=bool(opts["backends"])))
    return C.exit_code(table)


def one_run(a: argparse.Namespace, side: Side, rid: str, args: list[str], folder: Path, what: str) -> Optional[int]:
    """One harness.run of one side; its output goes to ``folder``/gate.log. None when it ran and wrote rows, else
    the gate's exit code (1: NEW failed, 2: BASE failed), after one line saying why."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / results.GATE_LOG
    t0 = time.monotonic()
    try:
        with open(log, "w") as fh:
            proc = subprocess.run([a.python, "-m", "harness.run", *args], cwd=side.src, env=run_env(side),
                                  stdout=fh, stderr=subprocess.STDOUT, timeout=a.run_timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = f"no exit after {a.run_timeout:g} s"
    secs = time.monotonic() - t0
    try:
        rows = results.load(folder) if any(folder.rglob("*.csv")) else results.to_frame([])
    except results.ResultsFileError as e:
        print(f"harness.gate: {e}", file=sys.stderr)
        rows = results.to_frame([])
    ok = int((rows["status"] == "ok").sum()) if len(rows) else 0
    print(f"harness.gate: {what} {side.describe()}: {secs:.0f} s, {len(rows)} rows ({ok} ok) [{time_of_day()}]",
          flush=True)
    if rc == 0 and len(rows):
        return None
    why = f"exit {rc}" if isinstance(rc, int) else rc
    print(f"harness.gate: {side.label}'s harness.run failed ({why}, {len(rows)} rows; log: {log}): "
          f"{_last_line(log.read_text(errors='replace'))}", file=sys.stderr)
    return C.EXIT_REGRESSION if side.label == "NEW" else C.EXIT_USAGE


def time_of_day() -> str:
    """The time and the load average, for the log of a gate on a shared machine."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return f"{time.strftime('%H:%M:%S')}, load {load}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        a, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        base, new, opts = validate(a, overrides)
        return gate(a, overrides, base, new, opts)
    except (GateError, results.ResultsFileError) as e:
        print(f"harness.gate: {e}", file=sys.stderr)
        return C.EXIT_USAGE


if __name__ == "__main__":
    from harness.core.own_packages import exit_on_clash

    exit_on_clash()
    sys.exit(main())
