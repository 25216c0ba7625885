"""Render the tables of benchmarks/QUALITY.md from benchmarks/quality.py's quality.json.

    python benchmarks/quality_report.py quality.json > tables.md
"""

import json
import sys
from collections import defaultdict


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def num(x):
    return "-" if x is None else f"{x:.3f}"


def main(path):
    q = json.load(open(path))
    out = []
    # Table 1
    methods = defaultdict(lambda: defaultdict(list))
    for p in q["predictors"]:
        for name, m in p["methods"].items():
            methods[name]["pearson"].append(m["pearson"])
            methods[name]["recall"].append(m["recall"])
    out += ["| predictor | Pearson | top-K recall |", "|---|---|---|"]
    for name, m in methods.items():
        out.append(f"| {name} | {num(mean(m['pearson']))} | {pct(mean(m['recall']))} |")
    # miss vs sparsity
    by = defaultdict(list)
    for r in q["replay"]:
        by[r["target_sparsity"]].append(r)
    out += ["", "| target | realized | SPIN mean miss | SPIN p99 miss | random (floor) | "
                "oracle (limit) | Pearson | eligible rows |", "|---|---|---|---|---|---|---|---|"]
    for s, rs in sorted(by.items()):
        g = lambda k: mean([r[k] for r in rs])
        out.append(f"| {pct(s)} | {pct(g('realized_sparsity'))} | {pct(g('mean_miss'))} | "
                   f"{pct(g('p99_miss'))} | {pct(g('random_mean_miss'))} | "
                   f"{pct(g('oracle_mean_miss'))} | {num(g('pearson'))} | "
                   f"{sum(r['eligible_rows'] for r in rs)} |")
    # per layer at each sparsity
    layers = len(q["replay"][0]["per_layer"])
    out += ["", "| target | " + " | ".join(f"layer {i} miss" for i in range(layers)) + " |",
            "|---|" + "---|" * layers]
    for s, rs in sorted(by.items()):
        cells = [pct(mean([r["per_layer"][i]["mean_miss"] for r in rs])) for i in range(layers)]
        out.append(f"| {pct(s)} | " + " | ".join(cells) + " |")
    # studies
    for study, rows in q["studies"].items():
        var = defaultdict(lambda: defaultdict(list))
        for r in rows:
            var[r.get("variant", "")][r["target_sparsity"]].append(r)
        sps = sorted({r["target_sparsity"] for r in rows})
        out += ["", f"{study} study: mean miss (p99) at realized sparsity, averaged over traces",
                "", "| variant | " + " | ".join(pct(s) for s in sps) + " |",
                "|---|" + "---|" * len(sps)]
        for name, per in var.items():
            cells = []
            for s in sps:
                rs = per.get(s, [])
                cells.append(f"{pct(mean([r['mean_miss'] for r in rs]))} "
                             f"({pct(mean([r['p99_miss'] for r in rs]))}) @ "
                             f"{pct(mean([r['realized_sparsity'] for r in rs]))}")
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    # bpb
    base = q["bpb"][0]["bpb"]
    out += ["", "| indexer | realized sparsity | mean miss | held-out bits per byte | vs all-keep |",
            "|---|---|---|---|---|"]
    for b in q["bpb"]:
        name = "all-keep" if b["target_sparsity"] is None else f"SPIN {pct(b['target_sparsity'])}"
        out.append(f"| {name} | {pct(b['realized_sparsity'])} | {pct(b['mean_miss'])} | "
                   f"{b['bpb']:.4f} | {100 * (b['bpb'] / base - 1):+.2f}% |")
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1])
