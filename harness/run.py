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

from harness.config import ConfigError, register_configs

register_configs()


def _run_id_for_sweep(cfg: DictConfig) -> None:
    """Jobs of one multirun share a run_id (from the sweep folder) unless one was given."""
    if cfg.get("run_id") or os.environ.get("MOKBENCH_RUN_ID"):
        return
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            cfg.run_id = "sweep-" + "".join(ch for ch in hc.sweep.dir if ch.isalnum())[-14:]
    except ValueError:
        pass


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from harness.report_table import point_title, print_rows, summary_line
    from harness.runner import run_benchmark

    _run_id_for_sweep(cfg)
    try:
        df = run_benchmark(cfg)
    except ConfigError as e:
        print(f"mokbench: invalid configuration: {e}", file=sys.stderr)
        sys.exit(2)
    if cfg.print_table and len(df):
        print_rows(df, point_title())
    if len(df):  # rank 0 (and the launching process): where the rows went
        print(summary_line(df, cfg.results_dir), flush=True)


if __name__ == "__main__":
    main()
