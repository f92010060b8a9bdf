"""``python -m harness.slurm``: the Slurm commands (collect), run from harness.launch.slurm."""

import runpy

runpy.run_module("harness.launch.slurm", run_name="__main__", alter_sys=True)
