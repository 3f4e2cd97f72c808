#!/usr/bin/env python3
"""Wire bytes per site per round of DiLoCoX's two exchanges against the number of sites, from the kernel's counters.

Reads the runs of a sweep over --set clusters=... --set exchange=gather,reduce at a fixed rank (--set adaptive=false, so
every round sends the same payload) and prints one markdown table: per exchange and site count, the bytes each site's
uplink carried per round (the kernel's counter over the run / sites / rounds), that over the 2-site figure, and the
growth the collective's law predicts from 2 sites: (n - 1) for the gather, 2(n - 1)/n / 1 for the ring all-reduces.
Also each design's bytes over the gather's at the same site count, and the kernel's bytes over the method's own
payload count, which differ by the TCP/IP framing.

    scripts/exchange-scaling.py results/reference/exchange-scaling-tiny
    scripts/exchange-scaling.py DIR [DIR ...]    (the runs of several sweeps, e.g. 2 and 20 sites on one link)
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.run.folder import find_run_dirs, read_summary

LAWS = {"gather": lambda n: n - 1, "reduce": lambda n: 2 * (n - 1) / n}


def rows(results: list[Path]) -> list[dict]:
    out = []
    for run_dir, _ in find_run_dirs(results):
        summary = read_summary(run_dir)
        if summary.get("status") != "ok" or summary["method"] != "dilocox":
            continue
        sites, rounds = summary["clusters"], summary["sync_count"]
        out.append(
            {
                "exchange": summary["method_options"]["exchange"],
                "sites": sites,
                "per_site_round": summary["wire_bytes"] / sites / rounds,
                "framing": summary["wire_bytes"] / summary["payload_bytes"],
            }
        )
    return sorted(out, key=lambda r: (r["exchange"], r["sites"]))


def table(measured: list[dict]) -> str:
    lines = [
        "| exchange | sites | wire B per site per round | vs 2 sites | law | measured / law | vs gather "
        "| kernel / payload |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    two = {r["exchange"]: r["per_site_round"] for r in measured if r["sites"] == 2}
    gather = {r["sites"]: r["per_site_round"] for r in measured if r["exchange"] == "gather"}
    for r in measured:
        law = LAWS[r["exchange"]](r["sites"]) / LAWS[r["exchange"]](2)
        growth = r["per_site_round"] / two[r["exchange"]] if r["exchange"] in two else float("nan")
        versus = r["per_site_round"] / gather[r["sites"]] if r["sites"] in gather else float("nan")
        lines.append(
            f"| {r['exchange']} | {r['sites']} | {r['per_site_round']:,.0f} | {growth:.3f}x | {law:.3f}x | "
            f"{growth / law:.3f} | {versus:.3f}x | {r['framing']:.4f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(table(rows([Path(arg) for arg in sys.argv[1:]])))
