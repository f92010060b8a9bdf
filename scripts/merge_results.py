"""Bundle every result row under SRC into one file per run_id in DST (for shipping results off a GPU machine).

    python scripts/merge_results.py SRC DST
"""

from __future__ import annotations

import sys

from harness import results


def main(src: str, dst: str) -> None:
    df = results.load(src)
    for run_id, rows in df.groupby("run_id"):
        results.write_rows(f"{dst}/{run_id}.csv", rows.to_dict("records"))
    cols = ["backend", "shape", "precision", "direction", "status", "latency_ms", "tflops_per_gpu", "dispatch_gb_s",
            "combine_gb_s", "raw_a2a_gb_s", "rel_err", "roofline_fraction", "error"]
    print(df[cols].to_string(max_colwidth=80))


if __name__ == "__main__":
    main(*sys.argv[1:3])
