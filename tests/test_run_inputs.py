"""Every bad input to ``python -m harness.run`` keeps the promise (one line naming the fix, exit code 2, nothing run or
written: no results file, no run folder, no sweep folder); a taken run id; Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
from conftest import HAS_GPU, ROOT, TESTS, compose_cfg

from harness.core import results
from harness.launch.cli import launcher_presets
from harness.config.launcher_options import LAUNCHER_SCHEMAS, launcher_keys

PRESETS = ", ".join(launcher_presets())
SLURM_KEYS = ", ".join(launcher_keys(LAUNCHER_SCHEMAS["slurm"]))
PREFIX = "mokbench: invalid configuration: "
H200 = ["-m", "hydra/launcher=h200_8gpu", "hydra.launcher.partition=gpu", "hydra.launcher.dry_run=true"]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MOKBENCH_RUN_ID"}
    return dict(env, PYTHONPATH=f"{TESTS}{os.pathsep}{ROOT}", HYDRA_FULL_ERROR="0", **extra)


def _run(*args: str, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.run", *args], cwd=ROOT, env=_env(**(env or {})),
                          capture_output=True, text=True, timeout=300)


def _refused(p: subprocess.CompletedProcess) -> str:
    """The one stderr line of a refused command (asserted: exit 2, one line, no traceback)."""
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(PREFIX), p.stderr[-3000:]
    assert "Traceback" not in p.stdout + p.stderr
    return lines[0].removeprefix(PREFIX)


# (arguments, the line), {tmp}: the test's folder. Each runs with results_dir={tmp}/a/results and its own
# hydra.sweep.dir, and must leave neither.
REFUSED = {
    "run id that climbs out": (["run_id=../../escape"], "run_id=../../escape is not a run name: use letters, digits, "
                               "'.', '_' and '-' only (no '/', not '.' or '..'); the rows go to "
                               "<results_dir>/<run_id>/"),
    "run id with a separator": (["run_id=a/b"], "run_id=a/b is not a run name"),
    "run id ..": (["run_id=.."], "run_id=.. is not a run name"),
    "run id of a sweep": (["-m", "run_id=../x", "workload.seed=1,2"], "all 2 sweep points: run_id=../x is not a run "
                          "name"),
    "dist_timeout_s=0": (["dist_timeout_s=0"], "dist_timeout_s must be between 1 and 31536000 seconds (got 0)"),
    "ranks_per_gpu on a CPU": (["device=cpu", "ranks_per_gpu=2"], "ranks_per_gpu=2 puts several ranks on one GPU, "
                               "and this run has none (device=cpu): drop ranks_per_gpu"),
    "ranks_per_gpu over more GPUs than a job gets": (["-m", "hydra/launcher=node", "hydra.launcher.gpus_per_node=1",
                                                     "hydra.launcher.dry_run=true", "ep_size=4", "ranks_per_gpu=2"],
                                                    "ep_size=4 needs 2 GPUs at ranks_per_gpu=2 but a job gets 1"),
    "ranks_per_gpu in tasks of their own": ([*H200, "ranks_per_gpu=2"], "ranks_per_gpu=2 runs its ranks as processes "
                                            "that one task spawns on its GPUs: set hydra.launcher.tasks_per_node=1"),
    "ranks_per_gpu=0": (["ranks_per_gpu=0"], "ranks_per_gpu must be between 1 and 64 (got 0)"),
    "watchdog_s=0": (["watchdog_s=0"], "watchdog_s must be between 1 and 31536000 seconds, or null for no watchdog"),
    "compile_mode on a CPU": (["compile_mode=bogus"], "unknown compile_mode 'bogus'; choose one of: default, "
                              "reduce-overhead, max-autotune, max-autotune-no-cudagraphs, published"),
    "backend and backends": (["backend=mok_hopper", "backends=[nccl]"], "backend=mok_hopper conflicts with "
                             "backends=[nccl], which replaces it: give one of the two (backend=mok_hopper alone, or "
                             "backends=[nccl] alone)"),
    "direction and directions": (["direction=fwd", "directions=[bwd]"], "direction=fwd conflicts with "
                                 "directions=[bwd], which replaces it"),
    "precision and precision.name": (["precision=fp8", "precision.name=bf16"], "precision=fp8 conflicts with "
                                     "precision.name=bf16"),
    "a sweep point whose backend conflicts": (["-m", "backend=nccl,mok_hopper", "backends=[nccl]"],
                                              "sweep point #1 (backend=mok_hopper): backend=mok_hopper conflicts "
                                              "with backends=[nccl]"),
    "-m after the overrides": (["results_dir={tmp}/a/results", "-m", "workload.tokens_per_gpu=64,-1,128"],
                               "put -m (or --multirun) before the overrides: python -m harness.run -m "
                               "results_dir={tmp}/a/results workload.tokens_per_gpu=64,-1,128"),
    "--cfg after the overrides": (["workload.seed=3", "--cfg", "job", "device=cpu"], "put --cfg before the "
                                  "overrides: python -m harness.run --cfg job workload.seed=3 device=cpu"),
    "a launcher key in a plain run": (["hydra.launcher.partition=gpu"], "hydra.launcher.partition is an option of a "
                                      "mokbench sweep launcher: put -m first and pick a launcher (python -m "
                                      "harness.run -m hydra/launcher=<preset> hydra.launcher.partition=gpu ...); "
                                      f"presets: {PRESETS}"),
    "a launcher key on the basic launcher": (["-m", "hydra.launcher.dry_run=true"], "hydra.launcher.dry_run is an "
                                             "option of a mokbench sweep launcher"),
    "a launcher in a plain run": (["hydra/launcher=slurm", "hydra.launcher.partition=gpu"], "hydra/launcher=slurm "
                                  "picks the launcher of a sweep: put -m first (python -m harness.run -m "
                                  f"hydra/launcher=slurm ...); presets: {PRESETS}"),
    "unknown launcher key": ([*H200, "hydra.launcher.bogus_opt=3"], "unknown key 'hydra.launcher.bogus_opt'; the "
                             f"keys of the mokbench_slurm launcher: {SLURM_KEYS}"),
    "added launcher key": ([*H200, "+hydra.launcher.bogus_opt=3"], "unknown key 'hydra.launcher.bogus_opt'; the keys "
                           f"of the mokbench_slurm launcher: {SLURM_KEYS}"),
    "misspelled launcher key": ([*H200, "hydra.launcher.node=2"], "unknown key 'hydra.launcher.node' (did you mean "
                                "hydra.launcher.nodes?)"),
    "node launcher key": (["-m", "hydra/launcher=node", "hydra.launcher.tasks_per_node=8"], "unknown key "
                          "'hydra.launcher.tasks_per_node' (did you mean hydra.launcher.gpus_per_node?); the keys of "
                          "the mokbench_node launcher: dry_run, gpus_per_node"),
    "negative time limit": ([*H200, "hydra.launcher.timeout_min=-5"], "hydra.launcher.timeout_min must be >= 1 (got "
                            "-5)"),
    "no nodes": ([*H200, "hydra.launcher.nodes=0"], "hydra.launcher.nodes must be >= 1 (got 0)"),
    "no tasks": ([*H200, "hydra.launcher.tasks_per_node=0"], "hydra.launcher.tasks_per_node must be >= 1 (got 0)"),
    "negative GPUs": ([*H200, "hydra.launcher.gpus_per_node=-1"], "hydra.launcher.gpus_per_node must be >= 0 (or "
                      "null) (got -1)"),
    "no CPUs": ([*H200, "hydra.launcher.cpus_per_task=0"], "hydra.launcher.cpus_per_task must be >= 1 (or null)"),
    "nodes that ep_size overrides": ([*H200, "hydra.launcher.nodes=2", "ep_size=8"], "hydra.launcher.nodes=2 "
                                     "conflicts with ep_size=8, which sets the nodes of a job (ep_size / "
                                     "tasks_per_node = 1): give one of the two"),
}


@pytest.mark.parametrize("args,line", list(REFUSED.values()), ids=list(REFUSED))
def test_a_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, line):
    args = [a.format(tmp=tmp_path) for a in args]
    if not any(a.startswith("results_dir=") for a in args):
        args.append(f"results_dir={tmp_path}/a/results")
    p = _run(*args, f"hydra.sweep.dir={tmp_path}/sweep", f"hydra.run.dir={tmp_path}/hydra")
    assert line.format(tmp=tmp_path) in _refused(p)
    assert "GPU-hours" not in p.stdout  # refused before any plan is printed
    assert not (tmp_path / "a" / "results").exists() and not (tmp_path / "sweep").exists()
    assert not (tmp_path / "escape").exists() and not (tmp_path / "hydra").exists()


@pytest.mark.parametrize("args", [["backends=[nccl,bogus]"], ["workload.tokens_per_gpu=-5"], ["shape=kimi"],
                                  ["-m", "workload.tokens_per_gpu=64,-1"]], ids=lambda a: " ".join(a))
def test_a_refusal_leaves_no_hydra_folder_where_it_runs(tmp_path, args):
    """With Hydra's default folders (outputs/<date>/<time>, multirun/...) under the working folder: a refusal after
    Hydra composed the configuration (and made its run folder) leaves none of them; a folder that was there stays."""
    (tmp_path / "outputs" / "older").mkdir(parents=True)
    p = subprocess.run([sys.executable, "-m", "harness.run", *args, f"results_dir={tmp_path}/results"], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=300)
    _refused(p)
    left = sorted(str(f.relative_to(tmp_path)) for f in tmp_path.rglob("*"))
    assert left == ["outputs", "outputs/older"], left


def test_a_run_id_from_the_environment_is_a_name_too(tmp_path):
    p = _run(f"results_dir={tmp_path}/results", f"hydra.run.dir={tmp_path}/hydra",
             env={"MOKBENCH_RUN_ID": "../elsewhere"})
    assert _refused(p).startswith("MOKBENCH_RUN_ID=../elsewhere is not a run name")
    assert not (tmp_path / "results").exists() and not (tmp_path / "elsewhere").exists()


def test_the_suggested_order_of_a_flag_parses(tmp_path):
    """The command the -m line suggests runs the sweep's own validation (here: its one bad point)."""
    bad = _refused(_run(f"results_dir={tmp_path}/r", "-m", "workload.tokens_per_gpu=64,-1",
                        f"hydra.sweep.dir={tmp_path}/sweep"))
    suggested = bad.split("python -m harness.run ", 1)[1].split()
    assert suggested[0] == "-m"
    line = _refused(_run(*suggested))
    assert line == "sweep point #1 (workload.tokens_per_gpu=-1): tokens_per_gpu must be >= 1 (got -1)"
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "r").exists()


def test_nodes_are_honoured(tmp_path):
    p = _run(*H200, "hydra.launcher.nodes=2", f"hydra.sweep.dir={tmp_path}/sweep")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "#0   (defaults): 2 node(s) x 8 task(s), EP 16, 16 GPUs, cuda, time limit 60 min" in p.stdout
    assert "total: 1 jobs x 16 GPUs = 16 GPUs allocated, at most 16.0 GPU-hours" in p.stdout


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU: the no-GPU advice of a Hopper dry run cannot be provoked")
def test_the_hopper_dry_run_on_a_cpu_machine_says_once_what_works(tmp_path):
    """README's Hopper dry run on a machine without GPUs: the one problem of its 8 points once, with advice that
    plans the run when followed; the same launcher option without the dry run is refused (the points run here)."""
    base = ["-m", "+experiment=hopper_published", f"results_dir={tmp_path}/results"]
    line = _refused(_run(*base, "hydra.launcher.dry_run=true", f"hydra.sweep.dir={tmp_path}/s1"))
    assert line == ("all 8 sweep points: device=cuda but this machine has no GPU: run on the GPU machine, or plan its "
                    "run from here with hydra.launcher.gpus_per_node=<its GPUs> and hydra.launcher.dry_run=true (or "
                    "use device=cpu)")
    advice = "hydra.launcher.gpus_per_node=8"  # the advice, for the 8-GPU machine of the README
    p = _run(*base, "hydra.launcher.dry_run=true", advice, f"hydra.sweep.dir={tmp_path}/s2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "8 sweep points -> 8 run one after another on this machine" in p.stdout
    assert p.stdout.count("1 node(s) x 1 task(s), EP 8, 8 GPUs, cuda") == 8
    line = _refused(_run(*base, advice, f"hydra.sweep.dir={tmp_path}/s3"))
    assert line.startswith("hydra.launcher.gpus_per_node=8 but this machine has 0 GPU(s), and the points run here")
    assert not (tmp_path / "results").exists() and not (tmp_path / "s3").exists()


def test_a_planned_point_of_a_plain_sbatch_sweep_shares_the_run_folder(tmp_path):
    """slurm/submit.sh runs each planned point as a plain run with the sweep's run id and hydra.run.dir=<its point
    folder>: the point's file there (written by the dry run) says the run folder is the sweep's, not a repeat."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.config.point import resolve
    from harness.launch.cli import hydra_config
    from harness.measure.runner import _point_of_a_sweep
    from harness.config.launcher_options import POINT_FILE

    def run(run_id: str):
        return resolve(compose_cfg("device=cpu", "shape=tiny", f"run_id={run_id}"))

    sweep_1, another = run("sweep-1"), run("another")
    point = tmp_path / "sweep" / "3"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose(config_name="config", overrides=[f"hydra.run.dir={point}"], return_hydra_config=True)
    with hydra_config(cfg):
        assert not _point_of_a_sweep(sweep_1)
        point.mkdir(parents=True)
        (point / POINT_FILE).write_text("num: 3\nrun_id: sweep-1\n")
        assert _point_of_a_sweep(sweep_1)
        assert not _point_of_a_sweep(another)


def test_rows_of_files_before_the_appended_column_load_unchanged(tmp_path):
    old = results.to_frame([{"run_id": "r", "row_id": "a", "backend": "nccl", "status": "ok"}]).drop(
        columns="appended")
    old.to_csv(tmp_path / "old.csv", index=False)
    df = results.read_file(tmp_path / "old.csv")
    assert df["appended"].isna().all() and str(df["appended"].dtype) == "boolean"
    assert list(df.columns[: len(results.COLUMNS)]) == list(results.COLUMNS)


# ---------------------------------------------------------------------------------------------------------------
# runs (gloo ranks on this machine)

QUICK = ["device=cpu", "shape=tiny", "workload.tokens_per_gpu=64", "timing=quick", "timing.num_warmup=1",
         "timing.num_iters=2", "timing.phase_iters=2", "direction=fwd", "print_table=false"]


@pytest.mark.slow
def test_a_taken_run_id_is_refused_unless_appended(tmp_path):
    """A sweep's points share its run folder; another run with that run id is refused (one line naming the folder
    and the fix) unless append=true, whose rows say so; the closing line counts what the folder holds."""
    res = tmp_path / "results"
    run_dir = res / "good"
    p = _run("-m", *QUICK, "run_id=good", f"results_dir={res}", "workload.seed=1,2",
             f"hydra.sweep.dir={tmp_path}/sweep")
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(list(run_dir.glob("*.csv"))) == 2
    assert p.stdout.strip().splitlines()[-1].startswith(f"mokbench: 2 rows (2 ok) in {run_dir}, 1 of them from "
                                                        f"sweep point #1; report: ")

    fix = f"run_id=good is taken: {run_dir} already holds the rows of a run (2 files): give a new run_id, or " \
          "append=true to add this run's rows to it"
    assert _refused(_run(*QUICK, "run_id=good", f"results_dir={res}", f"hydra.run.dir={tmp_path}/h")) == fix
    assert _refused(_run("-m", *QUICK, "run_id=good", f"results_dir={res}", "workload.seed=3,4",
                         f"hydra.sweep.dir={tmp_path}/sweep2")) == f"all 2 sweep points: {fix}"
    line = _refused(_run(*QUICK, f"results_dir={res}", f"hydra.run.dir={tmp_path}/h",
                         env={"MOKBENCH_RUN_ID": "good"}))
    assert line.startswith(f"MOKBENCH_RUN_ID=good is taken: {run_dir} already holds")
    assert len(list(run_dir.glob("*.csv"))) == 2 and not (tmp_path / "sweep2").exists()

    p = _run(*QUICK, "run_id=good", "append=true", f"results_dir={res}", f"hydra.run.dir={tmp_path}/h")
    assert p.returncode == 0, p.stderr[-3000:]
    df = results.load(run_dir)
    assert len(df) == 3 and sorted(df["appended"].tolist()) == [False, False, True]
    assert p.stdout.strip().splitlines()[-1] == (
        f"mokbench: 3 rows (3 ok) in {run_dir}, 1 of them from this run; report: python -m harness.report {run_dir} "
        f"--out {res}/reports/good")


def _first_rows(run_root: Path, proc: subprocess.Popen, log: Path, after: str = "", timeout: float = 600) -> None:
    """Wait until a results file under ``run_root`` holds a row (and ``log`` holds ``after``): polled, no fixed
    sleep; fails if the process ends first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, log.read_text()[-3000:]
        files = list(run_root.glob("*/*.csv"))
        if files and after in log.read_text() and any(len(results.read_file(f)) for f in files):
            return
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no rows in {timeout} s:\n{log.read_text()[-3000:]}")


def _interrupt(tmp: Path, args: list[str], group: bool, after: str = "") -> tuple[int, str, Path]:
    """Start ``harness.run`` with a backend whose setup sleeps a minute after nccl's rows, send SIGINT once the first
    rows exist (to the process, or to its process group as a terminal's Ctrl-C does), and return its exit code,
    stderr and results folder."""
    res = tmp / "results"
    log = tmp / "stderr.log"
    env = _env(MOKBENCH_EXTRA_BACKENDS="slow_setup=fake_backends:SlowSetup")
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "harness.run", *args, *QUICK, f"results_dir={res}",
                                 f"hydra.run.dir={tmp}/hydra", f"hydra.sweep.dir={tmp}/sweep"], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=group)
        try:
            _first_rows(res, proc, log, after)
            os.killpg(proc.pid, signal.SIGINT) if group else proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return rc, log.read_text(), res


def _check_interrupted(rc: int, err: str, res: Path, rows: int) -> None:
    (run_dir,) = [d for d in res.iterdir() if d.is_dir()]
    lines = err.strip().splitlines()
    assert rc == 130, err[-3000:]
    assert lines[-1] == f"mokbench: interrupted: {rows} rows kept in {run_dir}", err[-3000:]
    assert sum("interrupted" in ln for ln in lines) == 1 and "Traceback" not in err, err[-3000:]
    df = results.load(run_dir)  # every file intact
    assert len(df) == rows and set(df["status"]) == {"ok"} and set(df["backend"]) == {"nccl"}


@pytest.mark.slow
@pytest.mark.parametrize("group", [False, True], ids=["SIGINT to the process", "Ctrl-C to the process group"])
def test_ctrl_c_keeps_the_rows_and_says_so_in_one_line(tmp_path, group):
    rc, err, res = _interrupt(tmp_path, ["backends=[nccl,slow_setup]"], group)
    _check_interrupted(rc, err, res, rows=1)


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.3, 0.8, 1.5, 3.0])
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(tmp_path, delay_s):
    """Ctrl-C while the modules load, while Hydra composes, or while the run starts: one line, exit 130, no traceback,
    nothing on stdout (no library's log lines), and a folder named in the line exists."""
    proc = subprocess.Popen([sys.executable, "-m", "harness.run", *QUICK, f"results_dir={tmp_path}/results",
                             f"hydra.run.dir={tmp_path}/hydra"], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        time.sleep(delay_s)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = err.strip().splitlines()
    if proc.returncode == 0:
        pytest.skip(f"the run ended before the Ctrl-C at {delay_s} s")  # a fast machine: nothing to interrupt
    assert proc.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert sum("interrupted" in ln for ln in lines) == 1 and lines[-1].startswith("mokbench: interrupted: "), err
    assert out == "", out[-2000:]
    named = lines[-1].partition(" rows kept in ")[2]
    assert all(Path(d).is_dir() for d in named.split(", ") if d), lines[-1]


def test_the_interrupted_line_stays_the_last_one(tmp_path):
    """A library's exit hook that logs at INFO (torch's FakeTensor cache stats, when the Ctrl-C came before torch set
    its loggers' levels and Hydra had set the root logger's) prints nothing after the line; the exit hooks still run
    (the process leaves through os._exit after them)."""
    ran = tmp_path / "hook-ran"
    code = ("import atexit, logging, pathlib, sys; sys.argv = ['x']; from harness import run; "
            "logging.basicConfig(level=logging.INFO); "
            f"atexit.register(lambda: pathlib.Path({str(ran)!r}).write_text('yes')); "
            "atexit.register(lambda: logging.getLogger('torch._subclasses.fake_tensor').info('cache stats')); "
            "run._interrupted()")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 130, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == "mokbench: interrupted: 0 rows kept (nothing was written)", p.stderr
    assert ran.read_text() == "yes"


@pytest.mark.slow
def test_ctrl_c_in_a_sweep_keeps_the_rows_of_every_point(tmp_path):
    """Interrupted in its second point (whose backend's setup sleeps), a sweep keeps the first point's rows."""
    rc, err, res = _interrupt(tmp_path, ["-m", "backend=nccl,slow_setup"], group=True,
                              after="point #1 tiny bf16 uniform EP2 T64 | slow_setup (1/1) | setup")
    _check_interrupted(rc, err, res, rows=1)
