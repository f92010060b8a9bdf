"""``python -m harness.slurm``: the Slurm commands (collect), run from harness.launch.slurm_accounting."""

import runpy

runpy.run_module("harness.launch.slurm_accounting", run_name="__main__", alter_sys=True)
