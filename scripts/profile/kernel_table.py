#!/usr/bin/env python3
"""Groups an `ncu --metrics gpu__time_duration.sum --csv` log by kernel name: calls, total
and mean time, share; prints the table sorted by total time and the grand total."""
import collections
import csv
import sys


def main(path):
    rows = []
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        rows.append((r["Kernel Name"], float(r["Metric Value"].replace(",", ""))))
    total = sum(t for _, t in rows) or 1.0
    by = collections.defaultdict(lambda: [0, 0.0])
    for name, t in rows:
        short = name.split("(")[0][:90]
        by[short][0] += 1
        by[short][1] += t
    print(f"# {len(rows)} kernels, {total / 1e6:.2f} ms of kernel time")
    print(f"{'ms':>9} {'share':>6} {'calls':>6} {'us/call':>8}  kernel")
    for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"{t / 1e6:9.3f} {100 * t / total:5.1f}% {n:6d} {t / n / 1e3:8.1f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
