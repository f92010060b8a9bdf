"""One line per profiled kernel launch from Nsight Compute's raw page: where a kernel's time goes, in the figures the
journal (lab/perf-notes.md) reasons with (bytes to and from HBM, the DRAM / L2 / SM throughput against their peaks, the
L2 hit rate, the tensor pipe, registers, occupancy, the largest warp stall reasons).

    ncu --import REPORT.ncu-rep --csv --page raw --print-units base > raw.csv
    python -m mok_tools.mok_hopper.ncu_summary raw.csv [--match REGEX]

Why: the backward's weight gradients run at 79% of the copy rate with their MMA and Q loads beside the stores, and which
resource holds them (HBM, L2 bandwidth, or the per-step waits) was argued from timings of variants only (the journal,
lab/perf-notes.md: the weight gradients as stores plus MMA). ``mok_tools/mok_hopper/ncu.sh`` profiles the backward's or
the forward's kernels on the GPU machine (its runtime reads the counters; ``--clock-control none`` leaves the clocks
alone) and runs this on the result.

The raw page is a CSV whose header names the metrics, then (with units printed) a row of units, then one row per
launch. Metrics that a section did not collect print as ``n/a``; numbers may carry thousands separators. Plain
``csv``, no pandas: it runs wherever ncu's output is read.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from typing import Optional

# (column title, candidate metric names in order of preference, scale to the printed unit)
COLUMNS: tuple[tuple[str, tuple[str, ...], float], ...] = (
    ("us", ("gpu__time_duration.sum",), 1e-3),
    ("HBM rd GB", ("dram__bytes_read.sum",), 1e-9),
    ("HBM wr GB", ("dram__bytes_write.sum",), 1e-9),
    ("HBM TB/s", ("dram__bytes.sum.per_second",), 1e-12),
    ("DRAM %", ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                "dram__throughput.avg.pct_of_peak_sustained_elapsed"), 1.0),
    ("L2 %", ("lts__throughput.avg.pct_of_peak_sustained_elapsed",), 1.0),
    ("L2 hit %", ("lts__t_sector_hit_rate.pct",), 1.0),
    ("L1 %", ("l1tex__throughput.avg.pct_of_peak_sustained_active",
              "l1tex__throughput.avg.pct_of_peak_sustained_elapsed"), 1.0),
    ("SM %", ("sm__throughput.avg.pct_of_peak_sustained_elapsed",), 1.0),
    ("tensor %", ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                  "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                  "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
                  "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"), 1.0),
    ("regs", ("launch__registers_per_thread",), 1.0),
    ("warps act %", ("sm__warps_active.avg.pct_of_peak_sustained_active",), 1.0),
)
# warp stall reasons, cycles per issued instruction (WarpStateStats): the name between these
STALL = re.compile(r"^smsp__average_warps?_(?:latency_)?issue_stalled_([a-z_]+?)(?:_per_issue_active)?\.ratio$")
TOP_STALLS = 4
TENSOR = re.compile(r"^sm__(pipe|inst_executed_pipe)_tensor\w*\.avg\.pct_of_peak_sustained_active$")


def number(text: str) -> Optional[float]:
    """ncu's printed value as a float ("1,234.5" -> 1234.5); None for n/a or text."""
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def read_raw(path: str) -> tuple[list[str], list[dict[str, str]]]:
    """The metric names and one dict per launch (the units row, whose ID cell is empty, left out)."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.strip() and not line.startswith("==")]  # ncu's own notices
    reader = csv.reader(lines)
    header = next(reader)
    rows = [dict(zip(header, r)) for r in reader]
    return header, [r for r in rows if number(r.get("ID", "")) is not None]


def summarize(header: list[str], rows: list[dict[str, str]], match: Optional[str] = None) -> list[dict[str, object]]:
    """One dict per launch whose kernel name matches ``match`` (a regex; None: every launch): ``kernel``, each of
    :data:`COLUMNS` (None where no candidate was collected) and ``stalls``, the largest stall reasons."""
    pick = {title: next((m for m in names if m in header), None) for title, names, _ in COLUMNS}
    if pick["tensor %"] is None:  # the sections name the tensor pipe's use differently by ncu version and arch
        pick["tensor %"] = next((c for c in header if TENSOR.match(c)), None)
    stalls = {c: m.group(1) for c in header for m in [STALL.match(c)] if m}
    out = []
    for r in rows:
        name = r.get("Kernel Name", "")
        if match and not re.search(match, name):
            continue
        line: dict[str, object] = {"kernel": name.split("(")[0].strip()}
        for title, _, scale in COLUMNS:
            v = number(r[pick[title]]) if pick[title] else None
            line[title] = None if v is None else v * scale
        ranked = sorted(((number(r[c]) or 0.0, why) for c, why in stalls.items()), reverse=True)[:TOP_STALLS]
        line["stalls"] = ", ".join(f"{why} {v:.1f}" for v, why in ranked if v > 0)
        out.append(line)
    return out


def table(lines: list[dict[str, object]]) -> str:
    titles = ["kernel", *(t for t, _, _ in COLUMNS), "stalls"]
    head = "| " + " | ".join(titles) + " |\n|" + "---|" * len(titles) + "\n"

    def cell(v: object) -> str:
        if v is None:
            return "n/a"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    return head + "".join("| " + " | ".join(cell(line[t]) for t in titles) + " |\n" for line in lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw_csv", help="ncu --import R.ncu-rep --csv --page raw --print-units base > raw.csv")
    ap.add_argument("--match", help="only kernels whose name matches this regex")
    args = ap.parse_args(argv)
    header, rows = read_raw(args.raw_csv)
    if "Kernel Name" not in header:
        print(f"ncu_summary: {args.raw_csv} is not ncu's raw page (no 'Kernel Name' column): export it with "
              "ncu --import R.ncu-rep --csv --page raw", file=sys.stderr)
        return 2
    lines = summarize(header, rows, args.match)
    print(table(lines), end="")
    return 0 if lines else 1


if __name__ == "__main__":
    sys.exit(main())
