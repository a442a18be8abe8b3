#!/usr/bin/env python3
"""One TFLOP/s table for A/B runs: each LABEL=PATH is a bench JSON (benches/attention.rs or
scripts/torch_bench.py); rows are (pass, hd, seqlen, heads, causal), columns the labels (torch
JSONs give one column per backend), and the last column each label's ratio to torch-flash.

Usage: python3 scripts/ab_table.py LABEL=PATH [LABEL=PATH ...] [--passes fwd,bwd]
"""
import json
import sys

cols, rows, vals = [], [], {}
passes = ["fwd", "bwd"]
args = sys.argv[1:]
if "--passes" in args:
    i = args.index("--passes")
    passes = args[i + 1].split(",")
    del args[i:i + 2]
for arg in args:
    label, path = arg.split("=", 1)
    for r in json.load(open(path)):
        if r.get("pass") not in passes or "tflops" not in r:
            continue
        imp = r["impl"]
        if imp.startswith("torch-"):
            if imp not in ("torch-flash", "torch-cudnn"):
                continue
            col = imp
        elif imp == "candle-flash":
            col = label
        else:
            continue
        key = (r["pass"], r["hd"], r["seqlen"], f'{r["heads"]}/{r["heads_k"]}',
               "yes" if r["causal"] else "no")
        if key not in vals:
            rows.append(key)
            vals[key] = {}
        if col not in cols:
            cols.append(col)
        vals[key][col] = r["tflops"]
ours = [c for c in cols if not c.startswith("torch-")]
theirs = [c for c in cols if c.startswith("torch-")]
head = ["pass", "hd", "seqlen", "heads", "causal"] + ours + theirs + [f"{c}/FA2" for c in ours]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for key in sorted(rows, key=lambda k: (passes.index(k[0]), k[1], k[3], k[2], k[4])):
    v = vals[key]
    cells = [str(x) for x in key]
    cells += [f"{v[c]:.0f}" if c in v else "-" for c in ours + theirs]
    fa2 = v.get("torch-flash")
    cells += [f"{v[c] / fa2:.2f}" if c in v and fa2 else "-" for c in ours]
    print("| " + " | ".join(cells) + " |")
