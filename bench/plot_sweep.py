#!/usr/bin/env python3
"""plot_sweep.py: bus bandwidth against message size from sweep CSVs, one PNG per collective.

Reads the CSVs that `collectives_perf --csv` writes (columns collective, world_size, size_bytes,
count, dtype, op, root, time_us, algbw_gbps, busbw_gbps, wrong, and with --baseline mpi also
mpi_time_us, mpi_busbw_gbps, ...) and those of `gloo_perf --csv` (the same columns plus
implementation=gloo), and draws busbw (GB/s) against size (log2 axis, byte labels), one line per
(implementation or baseline, world size): "collectives 2 ranks", "MPI 2 ranks" (from the
mpi_busbw_gbps column), "Gloo 4 ranks", ...

    bench/plot_sweep.py --out DIR file1.csv [file2.csv ...]

writes DIR/busbw_<collective>.png for every collective found. Missing columns are tolerated:
busbw falls back to algbw x the bus factor, then to size / time x the bus factor; a missing
world size or collective reads as unknown; rows without a usable size or bandwidth (skipped sizes)
are dropped. When the same line label comes from more than one file (ours under --local and
under mpirun, say), the file's name is added to the label. When a collective was swept over
several dtypes or ops, they become part of the label too.

Needs python3 and matplotlib (Debian: python3-matplotlib); draws with the Agg backend, so no
display is needed.
"""

import argparse
import collections
import csv
import math
import os
import re
import sys

try:
    import matplotlib
except ImportError:
    # A python3 ahead of Debian's on PATH (pyenv, a venv) may lack python3-matplotlib: run
    # again under the system interpreter, which has it.
    SYSTEM_PYTHON = "/usr/bin/python3"
    if (os.path.exists(SYSTEM_PYTHON)
            and os.path.realpath(sys.executable) != os.path.realpath(SYSTEM_PYTHON)):
        os.execv(SYSTEM_PYTHON, [SYSTEM_PYTHON] + sys.argv)
    sys.exit("plot_sweep: matplotlib is missing (Debian: apt-get install python3-matplotlib)")

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib import ticker  # noqa: E402

# Display names of the values of the `implementation` column (rows without it are ours).
IMPLEMENTATION_NAMES = {
    "": "collectives",
    "collectives": "collectives",
    "ring": "collectives",
    "auto": "collectives",
    "gloo": "Gloo",
    "mpi": "MPI",
    "nccl": "NCCL",
}

# One colour family per implementation; world sizes get shades within the family.
COLOR_MAPS = {"collectives": "Blues", "MPI": "Oranges", "Gloo": "Greens", "NCCL": "Purples"}
FALLBACK_COLOR_MAPS = ["Reds", "Greys", "YlOrBr", "PuRd"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
# Lines of one (implementation, world size) that differ in dtype, op or file.
LINESTYLES = ["-", "--", ":", "-."]


def bus_factor(collective, world_size):
    """busbw / algbw (nccl-tests conventions); None when the world size is unknown."""
    if world_size is None or world_size <= 0:
        return None
    n = float(world_size)
    if collective == "all_reduce":
        return 2.0 * (n - 1.0) / n
    if collective in ("all_gather", "reduce_scatter"):
        return (n - 1.0) / n
    if collective == "broadcast":
        return 1.0
    return None


def to_float(text):
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def to_int(text):
    value = to_float(text)
    return int(value) if value is not None else None


def bandwidth(row, collective, world_size, size, busbw_key, algbw_key, time_key):
    """busbw in GB/s from the first column that gives it; None when none does."""
    busbw = to_float(row.get(busbw_key))
    if busbw is not None:
        return busbw
    factor = bus_factor(collective, world_size)
    if factor is None:
        return None
    algbw = to_float(row.get(algbw_key)) if algbw_key else None
    if algbw is not None:
        return algbw * factor
    time_us = to_float(row.get(time_key))
    if time_us is not None and time_us > 0 and size:
        return size / (time_us * 1e-6) / 1e9 * factor
    return None


def read_points(path):
    """Yields (collective, implementation, world_size, dtype, op, size, busbw) from one CSV."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.strip() and not line.lstrip().startswith("#")]
    reader = csv.DictReader(lines)
    if not reader.fieldnames:
        return
    # Header names without surrounding spaces; keys as written.
    reader.fieldnames = [name.strip() for name in reader.fieldnames]
    fields = set(reader.fieldnames)
    size_key = next((k for k in ("size_bytes", "size", "bytes") if k in fields), None)
    if size_key is None:
        print(f"plot_sweep: {path}: no size column (size_bytes), skipped", file=sys.stderr)
        return
    dropped = 0
    for row in reader:
        size = to_int(row.get(size_key))
        if not size or size <= 0:
            dropped += 1
            continue
        collective = (row.get("collective") or "").strip() or "unknown"
        world_size = to_int(row.get("world_size"))
        dtype = (row.get("dtype") or "").strip()
        op = (row.get("op") or "").strip()
        implementation = IMPLEMENTATION_NAMES.get(
            (row.get("implementation") or "").strip().lower(),
            (row.get("implementation") or "").strip())
        ours = bandwidth(row, collective, world_size, size, "busbw_gbps", "algbw_gbps", "time_us")
        if ours is not None:
            yield collective, implementation, world_size, dtype, op, size, ours
        elif (row.get("time_us") or "").strip() or "time_us" not in fields:
            dropped += 1  # a size the sweep skipped has an empty time; this row is something else
        mpi = bandwidth(row, collective, world_size, size, "mpi_busbw_gbps", None, "mpi_time_us")
        if mpi is not None:
            yield collective, "MPI", world_size, dtype, op, size, mpi
    if dropped:
        print(f"plot_sweep: {path}: {dropped} rows without a usable size or busbw (no busbw, "
              "algbw or time column, or no collective / world size to derive it), skipped",
              file=sys.stderr)


def format_bytes(value, _position=None):
    value = int(round(value))
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= (1 << shift) and value % (1 << shift) == 0:
            return f"{value >> shift}{unit}"
    return f"{value}B"


def series_label(implementation, world_size, variant, source, show_source):
    ranks = f"{world_size} ranks" if world_size is not None else "? ranks"
    label = f"{implementation} {ranks}"
    if variant:
        label += f" {variant}"
    if show_source:
        label += f" ({source})"
    return label


def plot_collective(collective, series, out_dir, log_y):
    """series: {(implementation, world_size, variant, source): {size: [busbw, ...]}}."""
    # Lines whose label (without the file) comes from several files get the file's name.
    sources_per_label = collections.defaultdict(set)
    # The lines of one (implementation, world size) share a colour and a marker; they differ
    # in line style.
    lines_per_group = collections.defaultdict(list)
    for implementation, world_size, variant, source in series:
        sources_per_label[(implementation, world_size, variant)].add(source)
        lines_per_group[(implementation, world_size)].append((variant, source))
    for lines in lines_per_group.values():
        lines.sort()

    implementations = sorted({key[0] for key in series},
                             key=lambda name: (name not in COLOR_MAPS, name != "collectives", name))
    world_sizes = sorted({key[1] for key in series}, key=lambda n: (n is None, n or 0))
    fallback = iter(FALLBACK_COLOR_MAPS * 4)
    cmaps = {name: plt.get_cmap(COLOR_MAPS.get(name) or next(fallback)) for name in implementations}

    fig, ax = plt.subplots(figsize=(10, 6), dpi=110)
    all_sizes = set()
    keys = sorted(series, key=lambda k: (implementations.index(k[0]), world_sizes.index(k[1]),
                                         k[2], k[3]))
    for implementation, world_size, variant, source in keys:
        points = series[(implementation, world_size, variant, source)]
        sizes = sorted(points)
        values = [sum(points[s]) / len(points[s]) for s in sizes]
        all_sizes.update(sizes)
        sources = sources_per_label[(implementation, world_size, variant)]
        shade_index = world_sizes.index(world_size)
        shade = 0.45 + 0.5 * (shade_index + 1) / (len(world_sizes) + 1)
        line_index = lines_per_group[(implementation, world_size)].index((variant, source))
        marker_index = shade_index + line_index // len(LINESTYLES)
        ax.plot(sizes, values,
                label=series_label(implementation, world_size, variant, source, len(sources) > 1),
                color=cmaps[implementation](shade),
                marker=MARKERS[marker_index % len(MARKERS)], markersize=4, linewidth=1.6,
                linestyle=LINESTYLES[line_index % len(LINESTYLES)])

    ax.set_xscale("log", base=2)
    lo = int(math.floor(math.log2(min(all_sizes))))
    hi = int(math.ceil(math.log2(max(all_sizes))))
    step = max(1, math.ceil((hi - lo + 1) / 28))  # every power of 2 up to 8 B .. 1 GiB
    ax.set_xticks([2.0 ** e for e in range(lo, hi + 1, step)])
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(format_bytes))
    ax.xaxis.set_minor_locator(ticker.FixedLocator([2.0 ** e for e in range(lo, hi + 1)]))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlim(2.0 ** lo / 1.3, 2.0 ** hi * 1.3)
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    if log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel("message size (bytes of the full result buffer)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"{collective}: bus bandwidth against message size")
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", axis="x", alpha=0.12)
    ax.legend(loc="upper left", fontsize=9, framealpha=0.9)
    fig.tight_layout()
    # The collective's name as the CSV wrote it, with anything but letters, digits, '_', '-' and
    # '.' as '_': a '/' in it named a folder that does not exist (a FileNotFoundError traceback).
    path = os.path.join(out_dir, f"busbw_{re.sub(r'[^A-Za-z0-9_.-]', '_', collective)}.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv):
    parser = argparse.ArgumentParser(
        description="Plot busbw against message size from collectives_perf / gloo_perf CSVs: "
                    "one PNG per collective, one line per (implementation, world size).")
    parser.add_argument("--out", required=True, help="folder for the PNGs (created if missing)")
    parser.add_argument("--log-y", action="store_true", help="logarithmic busbw axis")
    parser.add_argument("csv", nargs="+", help="sweep CSV files")
    args = parser.parse_args(argv)

    # collective -> (implementation, world_size, dtype, op, source) -> size -> [busbw]
    points = collections.defaultdict(
        lambda: collections.defaultdict(lambda: collections.defaultdict(list)))
    for path in args.csv:
        source = os.path.splitext(os.path.basename(path))[0]
        try:
            for collective, implementation, world_size, dtype, op, size, busbw in read_points(path):
                points[collective][(implementation, world_size, dtype, op, source)][size].append(
                    busbw)
        except (OSError, csv.Error, UnicodeDecodeError) as e:
            print(f"plot_sweep: {path}: {e}, skipped", file=sys.stderr)
    if not points:
        print("plot_sweep: no rows with a size and a bandwidth in the given files",
              file=sys.stderr)
        return 1

    os.makedirs(args.out, exist_ok=True)
    for collective in sorted(points):
        raw = points[collective]
        # dtype and op join the label only when this collective has more than one of them.
        show_dtype = len({key[2] for key in raw}) > 1
        show_op = len({key[3] for key in raw}) > 1
        series = collections.defaultdict(lambda: collections.defaultdict(list))
        for (implementation, world_size, dtype, op, source), by_size in raw.items():
            variant = " ".join(v for v, show in ((dtype, show_dtype), (op, show_op)) if show and v)
            for size, values in by_size.items():
                series[(implementation, world_size, variant, source)][size].extend(values)
        print(plot_collective(collective, series, args.out, args.log_y))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
