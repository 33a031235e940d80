#!/usr/bin/python3
"""Draws a sidecar evaluator's log (JSON lines, one record per checkpoint) as a PNG: one panel
per metric, the metric over the training step, the final checkpoint marked.

    scripts/plot-evaluations.py evaluations.jsonl                 # -> evaluations.png
    scripts/plot-evaluations.py evaluations.jsonl -o eval.png --metrics accuracy

Records are those SidecarEvaluator writes (include/collectives/evaluator.h):
    {"step": 470, "epoch": 1, "epoch_step": 0, "final": false,
     "metrics": {"loss": 0.45, "accuracy": 0.84}, "eval_seconds": 0.8, "time": 1796680000.1}
A line that does not parse (the last one, cut short by a crash) is skipped with a warning.
Needs Debian's python3 with python3-matplotlib. Exit status: 0, or 1 when there is nothing to
draw or the log cannot be read, 2 on a bad command line.
"""
import argparse
import json
import os
import sys


def read_records(path):
    records = []
    with open(path, encoding="utf-8") as log:
        for number, line in enumerate(log, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                int(record["step"])
                dict(record["metrics"])
            except (ValueError, KeyError, TypeError) as error:
                print(f"plot-evaluations: {path}:{number}: skipped, not a record ({error})",
                      file=sys.stderr)
                continue
            records.append(record)
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", help="the evaluator's JSON-lines log")
    parser.add_argument("-o", "--output", help="the PNG (default: the log's name with .png)")
    parser.add_argument("--metrics", help="comma-separated metrics to draw (default: all)")
    parser.add_argument("--title", help="the figure's title (default: the log's name)")
    args = parser.parse_args()
    try:
        records = read_records(args.log)
    except OSError as error:
        print(f"plot-evaluations: cannot read {args.log}: {error}", file=sys.stderr)
        return 1
    if not records:
        print(f"plot-evaluations: no records in {args.log}", file=sys.stderr)
        return 1
    names = []
    for record in records:
        names += [name for name in record["metrics"] if name not in names]
    if args.metrics:
        wanted = [name.strip() for name in args.metrics.split(",") if name.strip()]
        missing = [name for name in wanted if name not in names]
        if missing:
            print(f"plot-evaluations: no metric {', '.join(missing)} in {args.log} "
                  f"(it has {', '.join(names)})", file=sys.stderr)
            return 1
        names = wanted

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records.sort(key=lambda r: int(r["step"]))
    figure, axes = plt.subplots(len(names), 1, figsize=(7, 2.6 * len(names)), sharex=True,
                                squeeze=False)
    for axis, name in zip(axes[:, 0], names):
        points = [(int(r["step"]), r["metrics"][name]) for r in records
                  if isinstance(r["metrics"].get(name), (int, float))]
        axis.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3)
        final = [(int(r["step"]), r["metrics"][name]) for r in records
                 if r.get("final") and isinstance(r["metrics"].get(name), (int, float))]
        if final:
            step, value = final[-1]
            axis.plot([step], [value], marker="*", markersize=12, linestyle="none",
                      label=f"final: {value:.4g}")
            axis.legend(loc="best")
        axis.set_ylabel(name)
        axis.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("training step (optimizer iterations)")
    figure.suptitle(args.title or os.path.basename(args.log))
    figure.tight_layout()
    output = args.output or os.path.splitext(args.log)[0] + ".png"
    figure.savefig(output, dpi=100)
    print(f"plot-evaluations: {len(records)} evaluations, {', '.join(names)} -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
