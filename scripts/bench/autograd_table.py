#!/usr/bin/env python3
"""Attention through Candle's autograd against the kernels' own time, per grid shape.

Reads bench-attention JSON files (merged by median_json.py): the first with released
candle-core, the others with patched ones (scripts/bench/candle-patched.sh), each named
LABEL=PATH. Per shape: the kernels' own time (fwd + the direct backward, `FlashAttn::backward`)
of the first file, then for each file the forward + `loss.backward()` time and the kernels'
time of the same file over it (1.0 = autograd adds nothing).

Usage: python3 scripts/bench/autograd_table.py released=ours.json patched=ours-patched.json
"""
import json
import sys


def load(path):
    out = {}
    for r in json.load(open(path)):
        if r.get("impl") != "candle-flash":
            continue
        key = (r["hd"], r["seqlen"], r["heads"], r["heads_k"], r["causal"])
        out.setdefault(key, {})[r["pass"]] = r["ms"]
    return out


def main():
    if len(sys.argv) < 2 or any("=" not in a for a in sys.argv[1:]):
        sys.exit(__doc__)
    runs = [(a.split("=", 1)[0], load(a.split("=", 1)[1])) for a in sys.argv[1:]]
    base = runs[0][1]
    head = "| hd | seqlen | causal | heads | fwd ms | bwd ms | kernels ms |"
    rule = "|---:|---:|:---:|:---:|---:|---:|---:|"
    for label, _ in runs:
        head += f" fwd+bwd ms, {label} | kernels / autograd, {label} |"
        rule += "---:|---:|"
    print(head)
    print(rule)
    ratios = {label: [] for label, _ in runs}
    for key in sorted(base, key=lambda k: (k[2] != k[3], k[0], k[1], k[4])):
        passes = base[key]
        if not all(p in passes for p in ("fwd", "bwd", "fwd+bwd")):
            continue
        hd, seqlen, heads, heads_k, causal = key
        kernels = passes["fwd"] + passes["bwd"]
        row = (f"| {hd} | {seqlen} | {'yes' if causal else 'no'} | {heads}/{heads_k} "
               f"| {passes['fwd']:.3f} | {passes['bwd']:.3f} | {kernels:.3f} |")
        for label, run in runs:
            own = run.get(key, {})
            if not all(p in own for p in ("fwd", "bwd", "fwd+bwd")):
                row += " – | – |"
                continue
            ratio = (own["fwd"] + own["bwd"]) / own["fwd+bwd"]
            ratios[label].append(ratio)
            row += f" {own['fwd+bwd']:.3f} | {ratio:.2f} |"
        print(row)
    print()
    for label, rs in ratios.items():
        if rs:
            rs.sort()
            print(f"{label}: kernels / autograd min {rs[0]:.2f} median {rs[len(rs) // 2]:.2f} "
                  f"max {rs[-1]:.2f}; >= 0.9 at {sum(r >= 0.9 for r in rs)} of {len(rs)}")


if __name__ == "__main__":
    main()
