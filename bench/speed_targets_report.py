#!/usr/bin/env python3
"""Summarises a scripts/speed-targets.sh folder: one line per speed target with each round's
figure, their median and whether the median meets the target.

    bench/speed_targets_report.py OUT_DIR

Reads the r<round>_*.csv / .json / .log files the script writes; a file that is missing or holds
no matching row shows as '-' for that round. A file that is there but cannot be read (a column the
report needs is missing, a figure is not a finite number, the JSON does not parse) shows as '-'
too, and is named on stderr with what is wrong. Exits 1 if the folder holds no round at all or a
file could not be read.
"""

import csv
import glob
import json
import math
import os
import re
import statistics
import sys

MIB = 1 << 20


class BadFile(Exception):
    """A file of the folder that cannot be read; the message names it and what is wrong."""


def rounds(folder):
    found = set()
    for path in glob.glob(os.path.join(folder, "r*_*")):
        m = re.match(r"r(\d+)_", os.path.basename(path))
        if m:
            found.add(int(m.group(1)))
    return sorted(found)


def csv_rows(path, columns=()):
    """(line number, row) for each row of the CSV at `path`; none when it is missing or holds no
    row. Raises BadFile when it has rows but lacks one of `columns`."""
    if not os.path.exists(path):
        return []
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            rows = [(reader.line_num, row) for row in reader]
            fields = reader.fieldnames or []
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise BadFile(f"{path}: {e}") from e
    missing = [column for column in columns if column not in fields]
    if rows and missing:
        raise BadFile(f"{path}: no column {', '.join(missing)} (it has {', '.join(fields)})")
    return rows


def finite(path, line, row, column, convert=float):
    """The `column` of `row` (at `line` of `path`) as a finite number; raises BadFile if it is
    not one."""
    text = (row.get(column) or "").strip()
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value):
        raise BadFile(f"{path} line {line}: {column} '{text}' is not a finite number")
    return value


def mpi_ratio(path, collective, size):
    """our time / MPI's for one collective and size in a collectives_perf CSV, or None."""
    for line, row in csv_rows(path, ("collective", "size_bytes")):
        if (row["collective"] == collective
                and finite(path, line, row, "size_bytes", int) == size):
            ratio = (row.get("time_ratio_ours_over_mpi") or "").strip()
            return finite(path, line, row, "time_ratio_ours_over_mpi") if ratio else None
    return None


NO_KERNEL_RATIOS = (None, None, None, None)


def kernel_ratios(path, size):
    """(in place, out of place, plain loop, reading three buffers) f32 bytes/s over memcpy's at
    size, or Nones."""
    if not os.path.exists(path):
        return NO_KERNEL_RATIOS
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise BadFile(f"{path}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks", []), list):
        raise BadFile(f"{path}: not Google Benchmark's JSON (no list under 'benchmarks')")
    rate = {}
    for b in data.get("benchmarks", []):
        if not isinstance(b, dict):
            continue
        value = b.get("bytes_per_second")
        if b.get("aggregate_name") == "median" and isinstance(value, (int, float)):
            if not math.isfinite(value):
                raise BadFile(f"{path}: {b.get('run_name')}: bytes_per_second {value} is not a "
                              "finite number")
            rate[b.get("run_name")] = value
    memcpy = rate.get(f"BM_Memcpy/{size}")
    if not memcpy:
        return NO_KERNEL_RATIOS

    def over(name):
        value = rate.get(name)
        return value / memcpy if value else None

    return (over(f"ReduceInPlaceBench/f32_sum/{size}"), over(f"ReduceBench/f32_sum/{size}"),
            over(f"BM_PlainF32Add/{size}"), over(f"BM_ReadThreeF32/{size}"))


def wrong_elements(folder, round_):
    """Wrong result elements over the round's checked CSV rows (their `wrong` column), or None
    when no row of the round was checked."""
    total = None
    for path in sorted(glob.glob(os.path.join(folder, f"r{round_}_*.csv"))):
        for line, row in csv_rows(path):
            if (row.get("wrong") or "").strip():
                total = (total or 0) + finite(path, line, row, "wrong", int)
    return total


def packing_speedup(path):
    for line, row in csv_rows(path, ("mode", "speedup")):
        if row["mode"] == "packed":
            return finite(path, line, row, "speedup")
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

    bad_files = set()

    def read(figure, *args):
        """figure(*args), or None (shown as '-') when a file cannot be read, named on stderr."""
        try:
            return figure(*args)
        except BadFile as e:
            if str(e) not in bad_files:
                print(f"speed_targets_report: {e}", file=sys.stderr)
            bad_files.add(str(e))
            return None

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
                [read(mpi_ratio, path(r, f"all_reduce_{n}.csv"), "all_reduce", size)
                 for r in all_rounds],
                "<= 1.00", at_most(1.0))
    add("all-reduce 8 B, 2 ranks: ours/MPI time",
        [read(mpi_ratio, path(r, "all_reduce_8B_2.csv"), "all_reduce", 8) for r in all_rounds],
        "<= 1.20", at_most(1.2))
    for collective, label in (("broadcast", "broadcast"), ("all_gather", "all-gather")):
        for n in (2, 4):
            for size, tag in ((1 * MIB, "1M"), (16 * MIB, "16M")):
                add(f"{label} {size // MIB} MiB, {n} ranks: ours/MPI time",
                    [read(mpi_ratio, path(r, f"bcast_gather_{tag}_{n}.csv"), collective, size)
                     for r in all_rounds],
                    "<= 1.00", at_most(1.0))
    for size, label in ((4 << 10, "4 KiB"), (256 << 10, "256 KiB"), (4 * MIB, "4 MiB"),
                        (64 * MIB, "64 MiB")):
        ratios = [read(kernel_ratios, path(r, "kernels.json"), size) or NO_KERNEL_RATIOS
                  for r in all_rounds]
        add(f"f32 sum {label} in place: / memcpy", [x[0] for x in ratios], ">= 0.70",
            at_least(0.7))
        add(f"f32 sum {label} out of place: / memcpy", [x[1] for x in ratios], ">= 0.70",
            at_least(0.7))
        add(f"  (plain dst = a + b loop: / memcpy)", [x[2] for x in ratios], "reference", None)
        # The lines an out-of-place sum brings into the cache, read and nothing stored: its floor.
        add(f"  (reading a, b and dst, no store: / memcpy)", [x[3] for x in ratios], "reference",
            None)
    add("packed 1000 x 4 KiB, 4 ranks: speed-up",
        [read(packing_speedup, path(r, "packing.csv")) for r in all_rounds], ">= 10", at_least(10.0),
        "{:.1f}")
    # A target met with a wrong answer is not met: every run above checks its results
    # (--check), and one wrong element in any round fails this line.
    wrong = [read(wrong_elements, folder, r) for r in all_rounds]
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
    if bad_files:
        sys.exit("speed_targets_report: some files could not be read (see above)")


if __name__ == "__main__":
    main()
