#!/usr/bin/env python3
# Reproduces the tables of 2026-11-29-tc-generic.md from its rounds CSVs (see there).
"""Summary of kproxy-vs-Katran rounds CSVs, before vs after, one row per program and figure.

  summary.py pairs BEFORE.csv AFTER.csv            # two runs (run.sh, one build each)
  summary.py ab RUN.csv:BSUF:ASUF [RUN.csv:BSUF:ASUF ...]   # in-process A/B runs

pairs: per N (1, 1k, 10k, 100k) the kproxy medians' after/before, and kproxy/Katran (ratio of
medians, Katran from the same run as the build) before → after.
ab: per (run, N) the median over rounds of the per-round after/before ratio; shown: the median
of those [min..max] over every run and N, and kproxy/Katran before → after (median over runs
and N)."""
import csv, statistics as st, sys
from collections import defaultdict
NS = ("1", "1000", "10000", "100000")
FIGS = [("established", "est_1", "est_1"), ("new flow (Katran SYN)", "new_1", "new_syn_1"),
        ("reverse NAT", "rev_1", None), ("miss, 1 run", "miss_1", "miss_1"),
        ("miss, repeat (fine)", "miss_R_fine", "miss_R_fine")]
PROGS = (("XDP", "kproxy-xdp"), ("TC in", "kproxy-tc-in"), ("TC eg", "kproxy-tc-eg"))
def load(p):
    r = defaultdict(lambda: defaultdict(dict))
    for x in csv.DictReader(open(p)):
        r[x["program"]][x["figure"]][int(x["round"])] = float(x["value_ns"])
    return r
def med(r, prog, fig):
    v = list(r.get(prog, {}).get(fig, {}).values())
    return st.median(v) if v else None
mode = sys.argv[1]
if mode == "pairs":
    a, b = load(sys.argv[2]), load(sys.argv[3])
    print("| program | figure | after/before, N = 1 / 1k / 10k / 100k | kproxy/Katran before → after, N = 1 / 1k / 10k / 100k |")
    print("|---|---|---|---|")
    for pn, pp in PROGS:
        for lab, fk, fkat in FIGS:
            r1, r2 = [], []
            for n in NS:
                xa, xb = med(a, f"{pp} N{n}", fk), med(b, f"{pp} N{n}", fk)
                if xa is None or xb is None:
                    continue
                r1.append(f"{xb / xa:.3f}")
                if fkat and pn != "TC eg":
                    ka, kb = med(a, f"katran scale_{n}", fkat), med(b, f"katran scale_{n}", fkat)
                    r2.append(f"{xa / ka:.2f} → {xb / kb:.2f}")
            if r1:
                print(f"| {pn} | {lab} | {' / '.join(r1)} | {' / '.join(r2) if r2 else '—'} |")
else:
    runs = []
    for spec in sys.argv[2:]:
        p, bs, as_ = spec.split(":")
        runs.append((load(p), bs, as_))
    print("| program | figure | after/before per round: median [min..max] of the 8 (run, N) medians | kproxy/Katran before → after (medians over runs and N) |")
    print("|---|---|---|---|")
    for pn, pp in PROGS:
        for lab, fk, fkat in FIGS:
            qs, kb_, ka_ = [], [], []
            for r, bs, as_ in runs:
                for n in NS:
                    ra, rb = r.get(f"{pp} N{n}{bs}", {}).get(fk), r.get(f"{pp} N{n}{as_}", {}).get(fk)
                    if not ra or not rb:
                        continue
                    qs.append(st.median([rb[k] / ra[k] for k in ra if k in rb]))
                    if fkat and pn != "TC eg":
                        k = med(r, f"katran scale_{n}", fkat)
                        kb_.append(st.median(ra.values()) / k)
                        ka_.append(st.median(rb.values()) / k)
            if qs:
                kk = f"{st.median(kb_):.2f} → {st.median(ka_):.2f}" if kb_ else "—"
                print(f"| {pn} | {lab} | {st.median(qs):.3f} [{min(qs):.3f}..{max(qs):.3f}] | {kk} |")
