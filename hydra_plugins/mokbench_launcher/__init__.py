"""mokbench's Hydra launchers: hydra-submitit-launcher's, with validation, a dry run and failure rows, and Hydra's
basic launcher with the same validation and dry run; and its sweeper: Hydra's basic one, validating every point of
a sweep before any runs, whatever the launcher.

Hydra instantiates launchers and sweepers only from the ``hydra_plugins`` namespace, so the classes live here; their
behaviour is in :mod:`harness.launch.slurm_launch` and :mod:`harness.launch.cli`. Hydra's plugin scan imports this
module, which also registers the ``hydra/launcher=mokbench_slurm`` / ``mokbench_local`` / ``mokbench_node`` schemas that
configs/hydra/launcher/* extend.
"""

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher

from harness.launch.cli import SweepValidationMixin
from harness.config.launcher_options import register_launcher_configs
from harness.launch.slurm_launch import MokbenchLauncherMixin, NodeLauncherMixin


class SlurmLauncher(MokbenchLauncherMixin, BaseSubmititLauncher):
    """Preemption: submitit calls the inherited ``checkpoint`` on its signal and requeues the job, which reruns the
    point from the start (a benchmark has no state worth resuming)."""

    _EXECUTOR = "slurm"


class LocalLauncher(MokbenchLauncherMixin, BaseSubmititLauncher):
    _EXECUTOR = "local"


class NodeLauncher(NodeLauncherMixin, BasicLauncher):
    """This machine, one point after another in this process."""


class Sweeper(SweepValidationMixin, BasicSweeper):
    """Hydra's basic sweeper, validating every point before any runs (configs/hydra/sweeper/mokbench.yaml)."""


register_launcher_configs()
