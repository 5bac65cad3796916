"""Nsight Compute's per-kernel report (``ncu --csv --page details``) as a results JSON: every metric
of every profiled kernel, and a one-line digest per kernel (duration, DRAM and L2 throughput,
occupancy, registers, spills) printed.

On the H200 machine (its runtime reads the hardware counters; leave the clocks alone)::

    ncu --clock-control none --target-processes all -k regex:"_delayed_cast_kernel|_grouped_fprop_kernel" \\
        --launch-skip 42 --launch-count 14 --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \\
        --section ComputeWorkloadAnalysis --csv --page details \\
        python3 benchmarks/moe_block.py --cases qwen3_30b_a3b --precision fp8 --iters 2 --warmup 3 > ncu.csv
    python benchmarks/ncu_summary.py ncu.csv --tag s28_fp8_block
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import write_results  # noqa: E402

DIGEST = ["Duration", "DRAM Throughput", "L2 Cache Throughput", "Compute (SM) Throughput", "Achieved Occupancy",
          "Registers Per Thread", "Local Memory Spilling Requests", "Eligible Warps Per Scheduler",
          "Issue Slots Busy"]


def parse(text: str) -> list[dict]:
    """``[{"id", "kernel", "grid", "block", "metrics": {section: {name: [value, unit]}}}]`` in report
    order; lines before the CSV header (ncu's warnings) are skipped."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(line for line in lines[header:] if line.startswith('"')))):
        if not row["Metric Name"]:
            continue
        entry = kernels.setdefault(row["ID"], {"id": int(row["ID"]), "kernel": row["Kernel Name"],
                                               "grid": row["Grid Size"], "block": row["Block Size"], "metrics": {}})
        entry["metrics"].setdefault(row["Section Name"], {})[row["Metric Name"]] = [row["Metric Value"],
                                                                                   row["Metric Unit"]]
    return list(kernels.values())


def digest(kernel: dict) -> str:
    flat = {name: value for section in kernel["metrics"].values() for name, value in section.items()}
    parts = [f"{name} {flat[name][0]}{flat[name][1]}" for name in DIGEST if name in flat]
    return f"{kernel['id']:>3} {kernel['kernel'][:28]:<28} {kernel['grid']:<14} " + "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("csv_path")
    parser.add_argument("--tag", default="")
    parser.add_argument("--note", default="", help="where and on which tree the report was taken")
    args = parser.parse_args()
    kernels = parse(Path(args.csv_path).read_text())
    for kernel in kernels:
        print(digest(kernel))
    write_results("ncu" + (f"_{args.tag}" if args.tag else ""), {"source": Path(args.csv_path).name,
                                                                  "note": args.note, "kernels": kernels})


if __name__ == "__main__":
    main()
