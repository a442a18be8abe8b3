#!/usr/bin/env python3
"""Puts our benchmark next to PyTorch's: one markdown table per pass, and optionally a PNG.

Inputs are JSON lists of records {impl, pass, hd, seqlen, batch, heads, heads_k, causal, ms,
tflops} as written by benches/attention/ (impl "candle-flash", "candle-naive") and
scripts/bench/torch_bench.py ("torch-flash", "torch-cudnn"). Records without `tflops` but with
`gbps` are shown in GB/s.

Our "bwd" is `FlashAttn::backward` called directly (the kernels alone, as torch's
`torch.autograd.grad` times them); the ratios of the bwd table use it. Our "bwd-autograd"
(the same backward through Candle's `loss.backward()`, with its per-gradient bookkeeping) gets
no table of its own: it is the bwd table's "ours via autograd" column. (Bench JSON written
before the bench had "bwd-autograd" recorded the autograd figure as "bwd".) "fwd+bwd" runs
through autograd on both sides.

Decode records (pass "decode", with `gbps` of K+V read) get a table of their own, one row per
(batch, L): ours against PyTorch SDPA's backends (impl "torch-<backend>", "-packed" for the
form with the query heads of a K/V group packed as rows, "+graph" for CUDA-graph replays),
and as a % of the device copy bandwidth (pass "copy": the higher of our bench's "copy" and
"torch-copy"). The ratio ours/best-torch is best torch ms / our ms (> 1: we are faster),
against the fastest eager torch form, as our own timing is eager; the CUDA-graph figures
follow in their own columns.

A/B mode (--ab): one TFLOP/s table for runs of our bench side by side (kernel A/B runs).
Each argument is LABEL=PATH, a JSON of benches/attention/ or scripts/bench/torch_bench.py;
rows are (pass, hd, seqlen, heads, causal), columns the labels (a torch JSON gives one column
per backend, torch-flash and torch-cudnn), and the last columns each label's ratio to
torch-flash. --passes picks the passes (default fwd,bwd). A file that is missing is an error
here, not skipped.

Usage: python3 scripts/bench/compare.py OURS.json TORCH.json [MORE.json ...] [--png PATH]
       python3 scripts/bench/compare.py --ab LABEL=PATH [LABEL=PATH ...] [--passes fwd,bwd]
"""
import argparse
import json
import os
import sys

IMPLS = ["candle-flash", "torch-flash", "torch-cudnn", "candle-naive"]
# candle-flash-attn 0.11.1 (FA2's forward kernels, what Candle users run today), from a
# comparison binary built outside this repository (../shared/GPU.md): a column and a ratio
# of the tables where any row has it.
CFA = "candle-flash-attn"
LABELS = {"candle-flash": "ours", "torch-flash": "torch flash", "torch-cudnn": "cuDNN",
          "candle-naive": "candle naive", CFA: "candle-flash-attn"}
COLORS = {"candle-flash": "C0", "torch-flash": "C1", "torch-cudnn": "C2", "candle-naive": "C3",
          CFA: "C5"}
PASS_ORDER = ["fwd", "bwd", "fwd+bwd"]
# Our backward through Candle's autograd: shown as a column of the bwd table, next to ours.
AUTOGRAD_PASS = "bwd-autograd"
OURS_AUTOGRAD = "candle-flash-autograd"
LABELS[OURS_AUTOGRAD] = "ours via autograd"
COLORS[OURS_AUTOGRAD] = "C4"
# Passes with their own tables, out of the per-pass ones above.
SPECIAL_PASSES = ("decode", "copy")
DECODE_ORDER = [(1, 8192), (8, 8192), (1, 65536), (32, 4096)]
# The target: at these (batch, L), >= this share of the copy bandwidth and no slower
# than the fastest torch backend.
DECODE_TARGET_SHAPES = [(8, 8192), (1, 65536)]
DECODE_TARGET_PCT = 80.0
OURS = "candle-flash"


def read(path):
    """The records of one bench JSON file (a list)."""
    with open(path) as f:
        return json.load(f)


def load(paths):
    records = []
    for path in paths:
        if not os.path.exists(path):
            print(f"compare: {path} not found, skipped", file=sys.stderr)
            continue
        records += read(path)
    return records


def value(r):
    return r.get("tflops", r.get("gbps"))


def heads(r):
    return f"{r.get('heads', '?')}/{r.get('heads_k', r.get('heads', '?'))}"


def is_gqa(hh):
    q, k = hh.split("/")
    return q != k


def table(records):
    """{pass: {(hd, seqlen, causal, heads): {impl: value}}}; a later record of a key wins.

    A "bwd-autograd" record of impl X goes to the "bwd" pass as impl "X-autograd"."""
    out = {}
    for r in records:
        if value(r) is None or r.get("pass") in SPECIAL_PASSES:
            continue
        key = (r["hd"], r["seqlen"], bool(r["causal"]), heads(r))
        pas, impl = r["pass"], r["impl"]
        if pas == AUTOGRAD_PASS:
            pas, impl = "bwd", impl + "-autograd"
        out.setdefault(pas, {}).setdefault(key, {})[impl] = value(r)
    return out


def columns(rows):
    """IMPLS, with candle-flash-attn last and "ours via autograd" after ours where any row
    has them."""
    impls = IMPLS + ([CFA] if any(CFA in v for v in rows.values()) else [])
    if not any(OURS_AUTOGRAD in v for v in rows.values()):
        return impls
    at = impls.index(OURS) + 1
    return impls[:at] + [OURS_AUTOGRAD] + impls[at:]


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
        impls = columns(tab[pas])
        lines += [f"### {pas} ({u})", "",
                  "| hd | seqlen | causal | heads | " + " | ".join(LABELS[i] for i in impls)
                  + " | ours/flash | ours/cuDNN |" + (" ours/candle-flash-attn |" if CFA in impls else ""),
                  "|---:|---:|:---:|:---:|" + "---:|" * (len(impls) + 2 + (CFA in impls))]
        for key in sorted(tab[pas], key=lambda k: (is_gqa(k[3]), k)):
            hd, seqlen, causal, hh = key
            v = tab[pas][key]
            ours = v.get("candle-flash")
            cells = [str(hd), str(seqlen), "yes" if causal else "no", hh]
            cells += [fmt(v.get(i)) for i in impls]
            cells += [fmt(ratio(ours, v.get("torch-flash")), ".2f"), fmt(ratio(ours, v.get("torch-cudnn")), ".2f")]
            if CFA in impls:
                cells.append(fmt(ratio(ours, v.get(CFA)), ".2f"))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def copy_gbps(records):
    """{impl: GB/s} of the copy records; a later record of an impl wins."""
    return {r["impl"]: r["gbps"] for r in records if r.get("pass") == "copy" and r.get("gbps")}


def decode_table(records):
    """{(batch, L): {impl: ms}} of the decode records; a later record of a key wins."""
    out = {}
    for r in records:
        if r.get("pass") == "decode" and r.get("ms"):
            out.setdefault((r["batch"], r["seqlen"]), {})[r["impl"]] = r
    return out


def best(recs, pred):
    """(ms, impl) of the fastest record whose impl satisfies pred, or (None, None)."""
    found = [(r["ms"], i) for i, r in recs.items() if pred(i)]
    return min(found) if found else (None, None)


def is_torch_eager(impl):
    return impl.startswith("torch-") and not impl.endswith("+graph")


def is_torch_graph(impl):
    return impl.startswith("torch-") and impl.endswith("+graph")


def backend_eager(recs, backend):
    """Cell for one torch backend: its fastest eager form, marked "ᵖ" when that is the packed one."""
    ms, impl = best(recs, lambda i: i in (backend, backend + "-packed"))
    return "–" if ms is None else f"{ms:.4f}" + ("ᵖ" if impl.endswith("-packed") else "")


def decode_markdown(records):
    dec = decode_table(records)
    if not dec:
        return ""
    copies = copy_gbps(records)
    # The device ceiling is the fastest copy measured: Candle's own copy kernel is slower than
    # the hardware (seen: 1.1 vs 4.3 TB/s on an H200), so "% of copy" uses the higher figure.
    copy_impl = max(copies, key=copies.get) if copies else None
    copy = copies.get(copy_impl)
    hh = {heads(r) for recs in dec.values() for r in recs.values()}
    hds = {r.get("hd") for recs in dec.values() for r in recs.values()}
    lines = [f"### decode (one query token, heads {', '.join(sorted(hh))}, hd "
             f"{', '.join(str(h) for h in sorted(hds, key=str))}; GB/s of K+V read)", ""]
    names = {"copy": "ours", "torch-copy": "torch"}
    lines.append("copy bandwidth (bytes read + written): " + (", ".join(
        f"{names.get(i, i)} {g:.0f} GB/s" for i, g in copies.items()) if copies else "not measured")
        + (f"; % of copy is against the {names.get(copy_impl, copy_impl)} figure" if copy else ""))
    lines.append("")
    lines += ["| b | L | ours ms | ours GB/s | % of copy | torch flash ms | torch cuDNN ms "
              "| best torch ms | best torch | ours/best torch | best torch graph ms | ours/best graph |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|:---|---:|---:|---:|"]
    order = {k: n for n, k in enumerate(DECODE_ORDER)}
    verdicts = []
    for key in sorted(dec, key=lambda k: (order.get(k, len(order)), k)):
        recs = dec[key]
        ours = recs.get(OURS)
        ours_ms = ours["ms"] if ours else None
        ours_gbps = ours.get("gbps") if ours else None
        pct = 100 * ours_gbps / copy if ours_gbps and copy else None
        best_ms, best_impl = best(recs, is_torch_eager)
        graph_ms, _ = best(recs, is_torch_graph)
        speed = ratio(best_ms, ours_ms)
        flag = " ⚠" if ours and ours.get("check") == "mismatch" else ""
        cells = [str(key[0]), str(key[1]), fmt(ours_ms, ".4f") + flag, fmt(ours_gbps, ".0f"), fmt(pct),
                 backend_eager(recs, "torch-flash"), backend_eager(recs, "torch-cudnn"),
                 fmt(best_ms, ".4f"), best_impl.removeprefix("torch-") if best_impl else "–",
                 fmt(speed, ".2f"), fmt(graph_ms, ".4f"), fmt(ratio(graph_ms, ours_ms), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
        if key in DECODE_TARGET_SHAPES:
            ok_bw = pct is not None and pct >= DECODE_TARGET_PCT
            ok_speed = speed is not None and speed >= 1.0
            verdicts.append(f"b={key[0]} L={key[1]}: {fmt(pct)}% of copy "
                            f"({'met' if ok_bw else 'missed'} >= {DECODE_TARGET_PCT:.0f}%), "
                            + (f"{speed:.2f}x best torch ({'met' if ok_speed else 'missed'} >= 1.00x)"
                               if speed is not None else "no torch figure"))
    lines += ["", "ᵖ: the packed form (q as (b, heads_k, group, d)) was this backend's faster one. "
              "⚠: our output failed the bench's check against an f32 reference. "
              "ours/best: best torch ms / ours ms, > 1 = ours faster."]
    if verdicts:
        lines += ["", "Target: " + "; ".join(verdicts) + "."]
    lines.append("")
    return "\n".join(lines)


def ab_markdown(labelled, ab_passes):
    """The --ab table. labelled: [(label, records)]; ab_passes: the passes shown, in order.
    Our records (impl candle-flash) go to the label's column; torch-flash and torch-cudnn
    records to a column of their own; other impls are left out."""
    cols, rows, vals = [], [], {}
    for label, records in labelled:
        for r in records:
            if r.get("pass") not in ab_passes or "tflops" not in r:
                continue
            imp = r["impl"]
            if imp.startswith("torch-"):
                if imp not in ("torch-flash", "torch-cudnn"):
                    continue
                col = imp
            elif imp == OURS:
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
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in sorted(rows, key=lambda k: (ab_passes.index(k[0]), k[1], k[3], k[2], k[4])):
        v = vals[key]
        cells = [str(x) for x in key]
        cells += [f"{v[c]:.0f}" if c in v else "-" for c in ours + theirs]
        fa2 = v.get("torch-flash")
        cells += [f"{v[c] / fa2:.2f}" if c in v and fa2 else "-" for c in ours]
        lines.append("| " + " | ".join(cells) + " |")
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
    ap.add_argument("json", nargs="+", help="record files (ours, torch, ...); LABEL=PATH with --ab")
    ap.add_argument("--png", metavar="PATH", help="also draw TFLOP/s vs seqlen")
    ap.add_argument("--ab", action="store_true", help="one A/B table of LABEL=PATH runs")
    ap.add_argument("--passes", default="fwd,bwd", help="the --ab table's passes (default fwd,bwd)")
    args = ap.parse_args()
    if args.ab:
        if args.png:
            ap.error("--png does not apply to --ab")
        labelled = []
        for arg in args.json:
            label, sep, path = arg.partition("=")
            if not sep:
                ap.error(f"--ab takes LABEL=PATH, not {arg}")
            labelled.append((label, read(path)))
        print(ab_markdown(labelled, args.passes.split(",")))
        return
    records = load(args.json)
    tab = table(records)
    decode = decode_markdown(records)
    if not tab and not decode:
        sys.exit("compare: no records")
    if tab:
        print(markdown(records, tab))
    if decode:
        print(decode)
    if args.png and tab:
        plot(records, tab, args.png)


if __name__ == "__main__":
    main()
