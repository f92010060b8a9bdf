"""``python -m harness.run``: the Hydra main.

    python -m harness.run                                    # the default for this machine
    python -m harness.run shape=glm_5_2 precision=fp8 backends=[nccl,reference] direction=fwd
    python -m harness.run -m shape=kimi_k2_7,glm_5_2 direction=fwd,bwd   # a sweep (multirun)

Ctrl-C keeps the rows written so far and ends with one line, ``mokbench: interrupted: N rows kept in <dir>`` (the
folders that exist), and exit code 130, at any moment: while the modules load, a handler installed first says that
nothing was written and leaves at once.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys


def _interrupted_while_loading(signum: int, frame: object) -> None:
    """Ctrl-C before the run's own handling is in place (the imports): nothing was written."""
    os.write(2, b"mokbench: interrupted: 0 rows kept (nothing was written)\n")
    os._exit(130)  # no traceback, no exit hooks of half-imported modules


if __name__ == "__main__":  # not in the ranks, which import this module as __mp_main__ and ignore SIGINT
    signal.signal(signal.SIGINT, _interrupted_while_loading)
    from harness.core.own_packages import exit_on_clash

    exit_on_clash()  # another distribution's baselines / contract on the path: one line, exit 2

from pathlib import Path  # noqa: E402 - after the handler: Ctrl-C while these load is one line too

import hydra  # noqa: E402
import pandas as pd  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from harness.config.schema import ConfigError, register_configs  # noqa: E402
from harness.config.validate import run_id_for_sweep  # noqa: E402

register_configs()
_task_started = False  # set once the task function runs: later errors are not Hydra's composition errors


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from harness.launch.cli import check_command_line, reject
    from harness.launch.run_table import point_title, print_rows
    from harness.measure.runner import run_benchmark

    global _task_started
    _task_started = True
    try:
        run_id_for_sweep(cfg)
        check_command_line(cfg)
        df = run_benchmark(cfg)
    except ConfigError as e:
        from harness.launch.run_folder import discard

        discard()  # Hydra's run folder, made before this check could run
        reject([str(e)])
    if cfg.print_table and len(df):
        print_rows(df, point_title())
    if len(df):  # rank 0 (and the launching process): where the rows went
        print(closing_line(df, cfg.results_dir), flush=True)


def closing_line(df: pd.DataFrame, results_dir: str) -> str:
    """Where this run's rows went and the command that reports them, counting what the run folder holds: where it
    held rows before (append=true, or the earlier points of a sweep) the line says how many are this run's."""
    from harness.core import results
    from harness.launch.run_table import summary_line
    from harness.measure.runner import sweep_point_num

    dirs = [Path(results_dir) / r for r in df["run_id"].dropna().unique()]
    try:
        held = results.load(*[d for d in dirs if d.is_dir()]) if dirs else df
    except (results.ResultsFileError, FileNotFoundError):
        held = df
    if len(held) <= len(df):
        return summary_line(df, results_dir)
    num = sweep_point_num()
    head, sep, tail = summary_line(held, results_dir).partition("; report: ")
    return f"{head}, {len(df)} of them from {'this run' if num is None else f'sweep point #{num}'}{sep}{tail}"


def _interrupted() -> None:
    """Ctrl-C: one line saying how many rows this process's runs (and the jobs it launched) keep, and where."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runner = sys.modules.get("harness.measure.runner")  # not imported yet: nothing was written
    n, dirs = runner.kept_rows() if runner is not None else (0, [])
    dirs = [d for d in dirs if Path(d).is_dir()]
    where = f" in {', '.join(dirs)}" if dirs else " (nothing was written)" if n == 0 else ""
    print(f"mokbench: interrupted: {n} rows kept{where}", file=sys.stderr, flush=True)
    # Exit hooks of libraries (torch's FakeTensor cache stats, logged at INFO when the Ctrl-C came before torch set
    # its loggers' levels) would print after that line: it stays the last one.
    logging.disable(logging.CRITICAL)
    # The exit hooks run here, then the process leaves with 130 at once: Python's own exit can turn 130 into death by
    # SIGINT (-2 to the caller) when the KeyboardInterrupt went up through code run by exec() of a string (a dataclass
    # being made while torch imports), whatever the exit code asked.
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(130)


def cli() -> None:
    """``main`` with Hydra's composition errors (unknown option, misspelled key, wrong type, unparsable override) and
    its argument parser's (a flag after the overrides) as one line naming the fix and exit code 2, like every other
    invalid configuration (harness.launch.cli); Ctrl-C as one line and exit code 130."""
    from harness.launch.cli import argv_line, hydra_error_line, reject

    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises them instead of printing its own multi-line report
    line = argv_line(sys.argv[1:])
    if line is not None:
        reject([line])
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # from here Ctrl-C is a KeyboardInterrupt
        main()
    except KeyboardInterrupt:
        _interrupted()
    except Exception as e:  # noqa: BLE001 - only composition errors are translated; the rest propagates
        line = None if _task_started else hydra_error_line(e)
        if line is None:
            raise
        reject([line])


if __name__ == "__main__":
    cli()
