#!/usr/bin/env python3
"""One decode step of an `ncu --metrics gpu__time_duration.sum --csv` log of the LLaMA example:
one period of the log's tail, from after the last-but-one launch of the longest kernel (the LM
head, once per step) to its last launch, grouped by name and grid in launch order (one kernel
serves several products of different shapes): calls, total and mean time."""
import csv
import sys


def main(path):
    rows = []
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            name = r["Kernel Name"].split("(")[0][:100] + " " + r.get("Grid Size", "").replace(" ", "")
            rows.append((name, float(r["Metric Value"].replace(",", ""))))
    if not rows:
        print("no kernels in", path)
        return
    tail = rows[len(rows) * 4 // 5:]
    head = max(tail, key=lambda r: r[1])[0]
    ends = [i for i, (n, _) in enumerate(rows) if n == head]
    step = rows[ends[-2] + 1:ends[-1] + 1] if len(ends) >= 2 else rows
    total = sum(t for _, t in step)
    order, by = [], {}
    for name, t in step:
        if name not in by:
            order.append(name)
            by[name] = [0, 0.0]
        by[name][0] += 1
        by[name][1] += t
    print(f"# one step: {len(step)} kernels, {total / 1e3:.1f} us of kernel time "
          f"({len(rows)} kernels in the log)")
    print(f"{'us':>9} {'share':>6} {'calls':>6} {'us/call':>8}  kernel (first launch order)")
    for name in order:
        n, t = by[name]
        print(f"{t / 1e3:9.1f} {100 * t / total:5.1f}% {n:6d} {t / n / 1e3:8.2f}  {name}")
    print("# launch order of the step:")
    print(" ".join(f"{name.split('<')[0][-28:]}:{t / 1e3:.1f}" for name, t in step[:80]))


if __name__ == "__main__":
    main(sys.argv[1])
