#!/usr/bin/env python3
"""Prints the kernel launches of an Nsight Compute CSV (ncu --csv --metrics
gpu__time_duration.sum) that ran at least MIN_US microseconds, in launch
order: launch id, grid, duration and the kernel's template arguments, so that
the phases of one operation (consecutive launches of one kernel) read as a
sequence. Usage: ncu_launches.py FILE.csv [MIN_US]"""
import csv
import sys


def main(path, min_us):
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu's own log lines are not CSV
    shown = total = 0
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        us = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}.get(r["Metric Unit"], 1.0) * v
        total += 1
        if us < min_us:
            continue
        name = r["Kernel Name"]
        args = name[name.find("<"):name.rfind(">") + 1] if "<" in name else name
        print("launch %5s grid %-14s %10.1f us  %s" % (r["ID"], r["Grid Size"], us, args))
        shown += 1
    print("%d of %d launches at or over %g us" % (shown, total, min_us))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 200.0)
