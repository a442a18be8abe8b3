#!/usr/bin/env python3
"""Merges benchmark JSON files of repeated runs into one: per record, the median time.

The lent GPUs drift by 3-10% between runs of one binary (clocks, neighbours), on our side and
on PyTorch's alike, so one run per side puts a coin flip into every ratio near 1.0. Runs
alternated within one `run` (ours, torch, ours, torch, ...) and merged by this script give
each side's median over the same stretch of time; scripts/bench/compare.py then reads the merged
files like single runs.

Records are matched on (impl, pass, hd, seqlen, batch, heads, heads_k, causal) and any other
non-measurement field; `ms` becomes the median over the runs that have the record (the
middle one, or the mean of the two middle ones), and `tflops` / `gbps` are rescaled to it.
A `runs` field says how many runs had it.

Usage: python3 scripts/bench/median_json.py OUT.json RUN1.json RUN2.json [...]
"""
import json
import statistics
import sys

MEASURED = {"ms", "tflops", "gbps", "runs"}


def key(record):
    return tuple(sorted((k, json.dumps(v)) for k, v in record.items() if k not in MEASURED))


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, inputs = sys.argv[1], sys.argv[2:]
    groups, order = {}, []
    for path in inputs:
        with open(path) as f:
            for record in json.load(f):
                k = key(record)
                if k not in groups:
                    groups[k] = []
                    order.append(k)
                groups[k].append(record)
    merged = []
    for k in order:
        records = groups[k]
        timed = [r for r in records if r.get("ms")]
        if not timed:
            merged.append(dict(records[0], runs=len(records)))
            continue
        ms = statistics.median(r["ms"] for r in timed)
        record = dict(timed[0], ms=ms, runs=len(timed))
        for rate in ("tflops", "gbps"):
            if timed[0].get(rate):
                # rate x ms is the same work in every run
                record[rate] = timed[0][rate] * timed[0]["ms"] / ms
        merged.append(record)
    with open(out, "w") as f:
        json.dump(merged, f, indent=1)
    print(f"median_json: {len(merged)} records from {len(inputs)} runs -> {out}")


if __name__ == "__main__":
    main()
