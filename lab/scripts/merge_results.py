"""Bundle every result row under SRC into one file per run_id in DST (for shipping results off a GPU machine).
Rows already in DST's file of a run are kept (a run may span several commands); a row present in both (same
row_id) is written once.

    python lab/scripts/merge_results.py SRC DST
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from harness import results


def main(src: str, dst: str) -> None:
    df = results.load(src)
    for run_id, rows in df.groupby("run_id"):
        path = Path(dst) / f"{run_id}.csv"
        if path.exists():
            rows = pd.concat([results.read_file(path), rows], ignore_index=True).drop_duplicates("row_id")
        results.write_rows(path, rows.to_dict("records"))
    cols = ["backend", "shape", "precision", "direction", "status", "latency_ms", "tflops_per_gpu", "dispatch_gb_s",
            "combine_gb_s", "raw_a2a_gb_s", "rel_err", "roofline_fraction", "error"]
    print(df[cols].to_string(max_colwidth=80))


if __name__ == "__main__":
    main(*sys.argv[1:3])
