"""The options of mokbench's sweep launchers (``hydra/launcher=mokbench_slurm`` / ``mokbench_local`` /
``mokbench_node``): their schemas, the one list of each launcher's keys and the least value of each count.
:mod:`harness.launch.slurm_launch` launches with them; :func:`harness.config.validate.check_launcher_options` checks
them, and :mod:`harness.launch.cli` a command line's launcher keys."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf


# Launcher options of ours (not submitit's): taken out before the rest goes to the submitit executor.
OWN_KEYS = ("dry_run", "nvlink_domain_nodes", "_target_")


@dataclass
class MokbenchSlurmConf(SlurmQueueConf):
    """hydra-submitit-launcher's Slurm options plus mokbench's."""

    _target_: str = "hydra_plugins.mokbench_launcher.SlurmLauncher"
    # extra srun flags for every job step (submitit's srun_args)
    srun_args: Optional[list[str]] = None
    # validate every point and print jobs / GPUs / GPU-hours, then stop without submitting
    dry_run: bool = False
    # nodes in one NVLink domain (18 on GB300 NVL72): a job with more nodes gets a warning
    nvlink_domain_nodes: Optional[int] = None


@dataclass
class MokbenchLocalConf(LocalQueueConf):
    _target_: str = "hydra_plugins.mokbench_launcher.LocalLauncher"
    dry_run: bool = False
    nvlink_domain_nodes: Optional[int] = None


@dataclass
class MokbenchNodeConf:
    """This machine, one point after another in this process (Hydra's basic launcher), every point validated first."""

    _target_: str = "hydra_plugins.mokbench_launcher.NodeLauncher"
    dry_run: bool = False
    # GPUs the points run on (each spawns its ranks on them); None: the GPUs this machine sees. Set it to plan a
    # GPU run from a machine without GPUs (hydra.launcher.dry_run=true hydra.launcher.gpus_per_node=2).
    gpus_per_node: Optional[int] = None


# executor -> the schema of its launcher's options (``hydra/launcher=mokbench_<executor>``), which the presets in
# configs/hydra/launcher extend: the one list of each launcher's keys
LAUNCHER_SCHEMAS: dict[str, type] = {"slurm": MokbenchSlurmConf, "local": MokbenchLocalConf, "node": MokbenchNodeConf}

# The launcher options that count something, and their least value (null, where a schema allows it: the default).
# Checked before any plan is printed or job submitted.
LAUNCHER_MINIMA = {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0, "cpus_per_task": 1, "cpus_per_gpu": 1,
                   "gpus_per_task": 1, "mem_gb": 1, "timeout_min": 1, "signal_delay_s": 0, "max_num_timeout": 0,
                   "array_parallelism": 1, "nvlink_domain_nodes": 1}

POINT_FILE = "mokbench.yaml"  # in each point's folder of the sweep: the point as validated (write_point)


def register_launcher_configs() -> None:
    """``hydra/launcher=mokbench_slurm`` / ``mokbench_local`` / ``mokbench_node``: the schemas the presets in
    configs/hydra/launcher extend. Called when Hydra's plugin scan imports ``hydra_plugins.mokbench_launcher``."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for executor, schema in LAUNCHER_SCHEMAS.items():
        cs.store(group="hydra/launcher", name=f"mokbench_{executor}", node=schema, provider="mokbench")


def launcher_keys(schema: type) -> list[str]:
    """The keys a launcher schema takes on the command line (``hydra.launcher.<key>``)."""
    return sorted(f.name for f in dataclasses.fields(schema) if not f.name.startswith("_"))
