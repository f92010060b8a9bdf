"""``python -m harness.run``: the Hydra main.

    python -m harness.run                                    # the default for this machine
    python -m harness.run shape=glm_5_2 precision=fp8 backends=[nccl,reference] direction=fwd
    python -m harness.run -m shape=kimi_k2_7,glm_5_2 direction=fwd,bwd   # a sweep (multirun)
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from harness.config import ConfigError, register_configs, run_id_for_sweep

register_configs()
_task_started = False  # set once the task function runs: later errors are not Hydra's composition errors


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from harness.report_table import point_title, print_rows, summary_line
    from harness.runner import run_benchmark

    global _task_started
    _task_started = True
    run_id_for_sweep(cfg)
    try:
        df = run_benchmark(cfg)
    except ConfigError as e:
        print(f"mokbench: invalid configuration: {e}", file=sys.stderr)
        sys.exit(2)
    if cfg.print_table and len(df):
        print_rows(df, point_title())
    if len(df):  # rank 0 (and the launching process): where the rows went
        print(summary_line(df, cfg.results_dir), flush=True)


def cli() -> None:
    """``main`` with Hydra's composition errors (unknown option, misspelled key, wrong type, unparsable override) as
    one line naming the fix and exit code 2, like every other invalid configuration (harness.cli)."""
    from harness.cli import hydra_error_line, reject

    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises them instead of printing its own multi-line report
    try:
        main()
    except Exception as e:  # noqa: BLE001 - only composition errors are translated; the rest propagates
        line = None if _task_started else hydra_error_line(e)
        if line is None:
            raise
        reject([line])


if __name__ == "__main__":
    cli()
