#!/usr/bin/env python3
"""Summarises a scripts/speed-targets.sh folder: one line per speed target with each round's
figure, their median and whether the median meets the target.

    bench/speed_targets_report.py OUT_DIR

Reads the r<round>_*.csv / .json / .log files the script writes; a file that is missing or holds
no matching row shows as '-' for that round. Exits 1 only if the folder holds no round at all.
"""

import csv
import glob
import json
import os
import re
import statistics
import sys

MIB = 1 << 20


def rounds(folder):
    found = set()
    for path in glob.glob(os.path.join(folder, "r*_*")):
        m = re.match(r"r(\d+)_", os.path.basename(path))
        if m:
            found.add(int(m.group(1)))
    return sorted(found)


def csv_rows(path):
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def mpi_ratio(path, collective, size):
    """our time / MPI's for one collective and size in a collectives_perf CSV, or None."""
    for row in csv_rows(path):
        if row["collective"] == collective and int(row["size_bytes"]) == size:
            ratio = row.get("time_ratio_ours_over_mpi", "")
            return float(ratio) if ratio else None
    return None


def kernel_ratios(path, size):
    """(in place, out of place, plain loop) f32 sum bytes/s over memcpy's at size, or Nones."""
    if not os.path.exists(path):
        return None, None, None
    with open(path) as f:
        data = json.load(f)
    rate = {}
    for b in data.get("benchmarks", []):
        if b.get("aggregate_name") == "median":
            rate[b["run_name"]] = b.get("bytes_per_second")
    memcpy = rate.get(f"BM_Memcpy/{size}")
    if not memcpy:
        return None, None, None

    def over(name):
        value = rate.get(name)
        return value / memcpy if value else None

    return (over(f"ReduceInPlaceBench/f32_sum/{size}"), over(f"ReduceBench/f32_sum/{size}"),
            over(f"BM_PlainF32Add/{size}"))


def wrong_elements(folder, round_):
    """Wrong result elements over the round's checked CSV rows (their `wrong` column), or None
    when no row of the round was checked."""
    total = None
    for path in sorted(glob.glob(os.path.join(folder, f"r{round_}_*.csv"))):
        for row in csv_rows(path):
            if row.get("wrong", ""):
                total = (total or 0) + int(row["wrong"])
    return total


def packing_speedup(path):
    for row in csv_rows(path):
        if row["mode"] == "packed":
            return float(row["speedup"])
    return None


def peak_rss_mib(path):
    """The largest rank's peak resident set in MiB, from GNU time's 'peak_rss_kib N' lines."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        values = [int(m.group(1)) for m in re.finditer(r"peak_rss_kib (\d+)", f.read())]
    return max(values) / 1024 if values else None


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    folder = sys.argv[1]
    all_rounds = rounds(folder)
    if not all_rounds:
        sys.exit(f"speed_targets_report: no r<N>_* files in {folder}")

    def path(round_, name):
        return os.path.join(folder, f"r{round_}_{name}")

    lines = []  # (target, values per round, goal text, meets(median), format)

    def add(target, values, goal, meets, fmt="{:.2f}"):
        lines.append((target, values, goal, meets, fmt))

    def at_most(limit):
        return lambda median: median <= limit

    def at_least(limit):
        return lambda median: median >= limit

    for n in (2, 4):
        for size in (1 * MIB, 16 * MIB, 64 * MIB):
            add(f"all-reduce {size // MIB} MiB, {n} ranks: ours/MPI time",
                [mpi_ratio(path(r, f"all_reduce_{n}.csv"), "all_reduce", size) for r in all_rounds],
                "<= 1.00", at_most(1.0))
    add("all-reduce 8 B, 2 ranks: ours/MPI time",
        [mpi_ratio(path(r, "all_reduce_8B_2.csv"), "all_reduce", 8) for r in all_rounds],
        "<= 1.20", at_most(1.2))
    for collective, label in (("broadcast", "broadcast"), ("all_gather", "all-gather")):
        for n in (2, 4):
            for size, tag in ((1 * MIB, "1M"), (16 * MIB, "16M")):
                add(f"{label} {size // MIB} MiB, {n} ranks: ours/MPI time",
                    [mpi_ratio(path(r, f"bcast_gather_{tag}_{n}.csv"), collective, size)
                     for r in all_rounds],
                    "<= 1.00", at_most(1.0))
    for size, label in ((4 << 10, "4 KiB"), (256 << 10, "256 KiB"), (4 * MIB, "4 MiB"),
                        (64 * MIB, "64 MiB")):
        ratios = [kernel_ratios(path(r, "kernels.json"), size) for r in all_rounds]
        add(f"f32 sum {label} in place: / memcpy", [x[0] for x in ratios], ">= 0.70",
            at_least(0.7))
        add(f"f32 sum {label} out of place: / memcpy", [x[1] for x in ratios], ">= 0.70",
            at_least(0.7))
        add(f"  (plain dst = a + b loop: / memcpy)", [x[2] for x in ratios], "reference", None)
    add("packed 1000 x 4 KiB, 4 ranks: speed-up",
        [packing_speedup(path(r, "packing.csv")) for r in all_rounds], ">= 10", at_least(10.0),
        "{:.1f}")
    # A target met with a wrong answer is not met: every run above checks its results
    # (--check), and one wrong element in any round fails this line.
    wrong = [wrong_elements(folder, r) for r in all_rounds]
    add("wrong result elements, all checked runs", wrong, "0 in every round",
        lambda _: all(v == 0 for v in wrong), "{:.0f}")
    add("256 MiB all-reduce, 4 ranks: peak RSS - tensor (MiB)",
        [None if v is None else v - 256 for v in (peak_rss_mib(path(r, "memory.log"))
                                                  for r in all_rounds)],
        "<= 32", at_most(32.0), "{:.1f}")

    width = max(len(line[0]) for line in lines)
    print(f"{'target':<{width}}  {'rounds':<{7 * len(all_rounds)}} median  goal       verdict")
    missed = 0
    for target, values, goal, meets, fmt in lines:
        shown = " ".join(f"{'-' if v is None else fmt.format(v):>6}" for v in values)
        present = [v for v in values if v is not None]
        median = statistics.median(present) if present else None
        if meets is None:
            verdict = ""
        elif median is None:
            verdict = "no data"
        elif meets(median):
            verdict = "met"
        else:
            verdict = "MISSED"
            missed += 1
        median_text = "-" if median is None else fmt.format(median)
        print(f"{target:<{width}}  {shown:<{7 * len(all_rounds)}} {median_text:>6}  {goal:<9}  "
              f"{verdict}")
    print(f"{missed} target(s) missed on the median of {len(all_rounds)} round(s)")


if __name__ == "__main__":
    main()
