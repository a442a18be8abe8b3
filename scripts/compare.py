#!/usr/bin/env python3
"""Puts our benchmark next to PyTorch's: one markdown table per pass, and optionally a PNG.

Inputs are JSON lists of records {impl, pass, hd, seqlen, batch, heads, heads_k, causal, ms,
tflops} as written by benches/attention.rs (impl "candle-flash", "candle-naive") and
scripts/torch_bench.py ("torch-flash", "torch-cudnn"). Records without `tflops` but with
`gbps` (decode) are shown in GB/s.

Usage: python3 scripts/compare.py OURS.json TORCH.json [MORE.json ...] [--png PATH]
"""
import argparse
import json
import os
import sys

IMPLS = ["candle-flash", "torch-flash", "torch-cudnn", "candle-naive"]
LABELS = {"candle-flash": "ours", "torch-flash": "torch flash", "torch-cudnn": "cuDNN",
          "candle-naive": "candle naive"}
COLORS = {"candle-flash": "C0", "torch-flash": "C1", "torch-cudnn": "C2", "candle-naive": "C3"}
PASS_ORDER = ["fwd", "bwd", "fwd+bwd"]


def load(paths):
    records = []
    for path in paths:
        if not os.path.exists(path):
            print(f"compare: {path} not found, skipped", file=sys.stderr)
            continue
        with open(path) as f:
            records += json.load(f)
    return records


def value(r):
    return r.get("tflops", r.get("gbps"))


def heads(r):
    return f"{r.get('heads', '?')}/{r.get('heads_k', r.get('heads', '?'))}"


def is_gqa(hh):
    q, k = hh.split("/")
    return q != k


def table(records):
    """{pass: {(hd, seqlen, causal, heads): {impl: value}}}; a later record of a key wins."""
    out = {}
    for r in records:
        if value(r) is None:
            continue
        key = (r["hd"], r["seqlen"], bool(r["causal"]), heads(r))
        out.setdefault(r["pass"], {}).setdefault(key, {})[r["impl"]] = value(r)
    return out


def passes(tab):
    return sorted(tab, key=lambda p: (PASS_ORDER.index(p) if p in PASS_ORDER else len(PASS_ORDER), p))


def unit(records, pas):
    return "GB/s" if all("tflops" not in r for r in records if r["pass"] == pas) else "TFLOP/s"


def fmt(x, spec=".1f"):
    return "–" if x is None else format(x, spec)


def ratio(a, b):
    return None if a is None or not b else a / b


def markdown(records, tab):
    lines = []
    for pas in passes(tab):
        u = unit(records, pas)
        lines += [f"### {pas} ({u})", "",
                  "| hd | seqlen | causal | heads | " + " | ".join(LABELS[i] for i in IMPLS)
                  + " | ours/flash | ours/cuDNN |",
                  "|---:|---:|:---:|:---:|" + "---:|" * (len(IMPLS) + 2)]
        for key in sorted(tab[pas], key=lambda k: (is_gqa(k[3]), k)):
            hd, seqlen, causal, hh = key
            v = tab[pas][key]
            ours = v.get("candle-flash")
            cells = [str(hd), str(seqlen), "yes" if causal else "no", hh]
            cells += [fmt(v.get(i)) for i in IMPLS]
            cells += [fmt(ratio(ours, v.get("torch-flash")), ".2f"), fmt(ratio(ours, v.get("torch-cudnn")), ".2f")]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(records, tab, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("compare: matplotlib not available, no plot", file=sys.stderr)
        return
    # One row per training pass (decode stays in the tables), one column per (hd, causal, heads).
    rows = [p for p in PASS_ORDER if p in tab]
    if not rows:
        print("compare: no fwd/bwd records to plot", file=sys.stderr)
        return
    panels = sorted({(k[0], k[2], k[3]) for p in rows for k in tab[p]},
                    key=lambda k: (is_gqa(k[2]), k))
    fig, axes = plt.subplots(len(rows), len(panels), figsize=(3.2 * len(panels), 2.8 * len(rows)),
                             squeeze=False, sharex=True)
    for ri, pas in enumerate(rows):
        for ci, (hd, causal, hh) in enumerate(panels):
            ax = axes[ri][ci]
            pts = {k[1]: v for k, v in tab[pas].items() if (k[0], k[2], k[3]) == (hd, causal, hh)}
            if not pts:
                ax.axis("off")
                continue
            for impl in IMPLS + sorted({i for v in pts.values() for i in v} - set(IMPLS)):
                xy = sorted((s, v[impl]) for s, v in pts.items() if impl in v)
                if xy:
                    ax.plot(*zip(*xy), marker="o", ms=3, label=LABELS.get(impl, impl), color=COLORS.get(impl))
            gqa = f" h{hh}" if is_gqa(hh) else ""
            ax.set_title(f"{pas}  hd{hd}{' causal' if causal else ''}{gqa}", fontsize=9)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
            if ci == 0:
                ax.set_ylabel(unit(records, pas))
            if ri == len(rows) - 1:
                ax.set_xlabel("seqlen")
    handles = {}  # one legend for the figure, in first-seen order
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="upper center", ncol=len(handles))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (2.8 * len(rows))))
    fig.savefig(path, dpi=110)
    print(f"compare: wrote {path}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="record files (ours, torch, ...)")
    ap.add_argument("--png", metavar="PATH", help="also draw TFLOP/s vs seqlen")
    args = ap.parse_args()
    records = load(args.json)
    tab = table(records)
    if not tab:
        sys.exit("compare: no records")
    print(markdown(records, tab))
    if args.png:
        plot(records, tab, args.png)


if __name__ == "__main__":
    main()
