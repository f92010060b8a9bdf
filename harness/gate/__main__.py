"""``python -m harness.gate``: the regression gate (two commits in interleaved rounds), run from harness.gate.gate."""

import runpy

runpy.run_module("harness.gate.gate", run_name="__main__", alter_sys=True)
