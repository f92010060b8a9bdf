"""``python -m harness.compare``: the regression verdict of two row sets, run from harness.gate.compare."""

import runpy

runpy.run_module("harness.gate.compare", run_name="__main__", alter_sys=True)
