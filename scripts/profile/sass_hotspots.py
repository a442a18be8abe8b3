#!/usr/bin/env python3
"""Summarises an `ncu --section SourceCounters --page source --print-source sass --csv` log
(scripts/profile/fp8.sh writes one): warp-stall samples by reason over the whole kernel, by
instruction kind (opcode), and the SASS lines with the most samples.

Usage: sass_hotspots.py LOG.csv [TOP]"""
import collections
import csv
import sys


def num(x):
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


def main(path, top=30):
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]
    start = next(i for i, l in enumerate(lines) if l.startswith('"Address"'))
    rows = list(csv.DictReader(lines[start:]))
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(num(r["Warp Stall Sampling (All Samples)"]) for r in rows) or 1.0
    print(f"# {len(rows)} SASS lines, {total:.0f} stall samples")
    by_reason = {k: sum(num(r[k]) for r in rows) for k in reasons}
    print("\n## samples by reason")
    for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1]):
        if v:
            print(f"{100 * v / total:5.1f}%  {k}")
    by_op = collections.defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        op = r["Source"].split()[0] if r["Source"].split() else "?"
        if op.startswith("@"):
            op = r["Source"].split()[1]
        op = op.split(".")[0]
        by_op[op][0] += num(r["Warp Stall Sampling (All Samples)"])
        by_op[op][1] += num(r["Instructions Executed"])
    execd = sum(v[1] for v in by_op.values()) or 1.0
    print("\n## by opcode: share of samples, share of executed warp instructions")
    for op, (s, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"{100 * s / total:5.1f}%  {100 * n / execd:5.1f}%  {op}")
    print(f"\n## top {top} lines: samples, main reasons")
    for r in sorted(rows, key=lambda r: -num(r["Warp Stall Sampling (All Samples)"]))[:top]:
        s = num(r["Warp Stall Sampling (All Samples)"])
        why = sorted(((num(r[k]), k[6:]) for k in reasons), reverse=True)[:2]
        why = ", ".join(f"{k} {100 * v / max(s, 1):.0f}%" for v, k in why if v)
        print(f"{100 * s / total:5.2f}%  {r['Address']:>6}  {r['Source'][:60]:<60}  {why}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)
