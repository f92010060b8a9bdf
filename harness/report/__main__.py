"""``python -m harness.report``: the report's command line, run from harness.report.report."""

import runpy

runpy.run_module("harness.report.report", run_name="__main__", alter_sys=True)
