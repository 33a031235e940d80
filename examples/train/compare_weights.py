#!/usr/bin/python3
"""Compares two weight files written by `train --save-weights` (raw little-endian float32).

    compare_weights.py A B [--rtol 1e-5] [--atol 1e-7]

They agree when they hold as many floats and every pair satisfies
|a - b| <= rtol * max(|a|, |b|) + atol (the absolute term covers weights near zero).
Prints the element count, the largest absolute and relative differences and the verdict.
Exit status: 0 when they agree, 1 when they do not, 2 on a bad command line or unreadable file.
"""
import argparse
import sys

import numpy as np


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--atol", type=float, default=1e-7)
    args = parser.parse_args()
    try:
        a = np.fromfile(args.a, dtype="<f4").astype(np.float64)
        b = np.fromfile(args.b, dtype="<f4").astype(np.float64)
    except OSError as e:
        print(f"compare_weights: {e}", file=sys.stderr)
        return 2
    if a.size != b.size or a.size == 0:
        print(f"FAIL: {args.a} holds {a.size} floats, {args.b} {b.size}")
        return 1
    diff = np.abs(a - b)
    scale = np.maximum(np.abs(a), np.abs(b))
    rel = np.divide(diff, scale, out=np.zeros_like(diff), where=scale > 0)
    bad = int(np.count_nonzero(diff > args.rtol * scale + args.atol))
    print(f"{a.size} weights: max |a - b| = {diff.max():.3g}, max relative = {rel.max():.3g}, "
          f"identical: {int(np.count_nonzero(diff == 0))}")
    if bad:
        print(f"FAIL: {bad} weights differ by more than {args.rtol:g} relative + {args.atol:g}")
        return 1
    print(f"ok: every weight agrees within {args.rtol:g} relative + {args.atol:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
