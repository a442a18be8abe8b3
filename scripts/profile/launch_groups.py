#!/usr/bin/env python3
"""Groups the launches of an `ncu --csv --page raw` log (scripts/profile/launches.sh) into runs
of similar duration (within 15%), in launch order: per run its first launch (as a
`--launch-skip` for the same kernel filter, given the skip the log was taken with), its length
and the mean of each of METRICS (comma-separated, as passed to ncu; the raw page holds every
device attribute besides). Lines that are not ncu's (the program's own output) are skipped.

Usage: launch_groups.py LOG.csv SKIP METRICS"""
import csv
import sys


def num(x):
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return None


def main(path, skip, metrics, tol=0.15):
    with open(path) as f:
        rows = list(csv.reader(l for l in f if l.startswith('"')))
    if len(rows) < 3:
        sys.exit(f"{path}: no launches")
    header, units, data = rows[0], rows[1], [r for r in rows[2:] if len(rows[0]) == len(r)]
    col = {h: i for i, h in enumerate(header)}
    counters = [m for m in metrics if m in col]
    dur = "gpu__time_duration.sum"
    groups = []  # [first index, launches]
    for i, r in enumerate(data):
        d = num(r[col[dur]])
        if groups and abs(d - groups[-1][2]) <= tol * groups[-1][2]:
            groups[-1][1].append(r)
        else:
            groups.append([i, [r], d])
    print(f"# {len(data)} launches of {data[0][col['Kernel Name']]}, {len(groups)} runs "
          f"(duration within {tol:.0%}); --launch-skip of a run's first = SKIP + index")
    short = {dur: "dur", "smsp__inst_executed.sum": "inst"}
    names = [short.get(c, c.replace("smsp__average_warps_issue_stalled_", "stall_")
                        .replace("_per_issue_active.ratio", "")
                        .replace(".avg.pct_of_peak_sustained_active", "%")) for c in counters]
    print("| skip | launches | " + " | ".join(names) + " |")
    print("|---:|---:|" + "---:|" * len(names))
    for first, rs, _ in groups:
        means = [sum(num(r[col[c]]) for r in rs) / len(rs) for c in counters]
        cells = [f"{m:.4g} {units[col[c]]}".strip() for m, c in zip(means, counters)]
        print(f"| {skip + first} | {len(rs)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","))
