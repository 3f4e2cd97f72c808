#!/usr/bin/env python3
"""What one slow site costs each method: its applied tokens/s on a profile with the slow site over its tokens/s on
the same sites without it, paired per seed, from a sweep over two profiles that differ in that one site.

Prints one markdown table: per method, the tokens/s on each profile (mean, 95% t interval), the paired ratio
(mean, interval, each seed's), and the kernel's wire bytes over the method's own payload count on each profile (the
bytes follow the method's collective, whatever the sites' rates: only the time moves).

    scripts/site-cost.py results/reference/uneven-sites-20-tiny spread straggler
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from harness.analysis.report.aggregates import Spread, spread
from harness.run.folder import find_run_dirs, read_summary


def _shown(value: Spread, digits: int = 0) -> str:
    if value.n < 3:
        return f"{value.mean:,.{digits}f} (n={value.n})"
    return f"{value.mean:,.{digits}f} +- {(value.high - value.low) / 2:,.{digits}f}"


def main(results: Path, even: str, uneven: str) -> str:
    runs: dict[tuple[str, str], dict[int, dict]] = defaultdict(dict)
    for run_dir, _ in find_run_dirs([results]):
        summary = read_summary(run_dir)
        if summary.get("status") == "ok" and summary["profile"] in (even, uneven):
            runs[(summary["method"], summary["profile"])][summary["seed"]] = summary
    lines = [
        f"| method | tokens/s, {even} | tokens/s, {uneven} | {uneven} / {even}, paired | per seed | "
        f"wire / payload, {even} | wire / payload, {uneven} |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for method in sorted({m for m, _ in runs}):
        fast, slow = runs[(method, even)], runs[(method, uneven)]
        seeds = sorted(set(fast) & set(slow))
        ratios = [slow[s]["tokens_per_s"] / fast[s]["tokens_per_s"] for s in seeds]
        framing = [
            spread(r["wire_bytes"] / r["payload_bytes"] for r in side.values() if r.get("payload_bytes"))
            for side in (fast, slow)
        ]
        lines.append(
            f"| {method} | {_shown(spread(r['tokens_per_s'] for r in fast.values()))} "
            f"| {_shown(spread(r['tokens_per_s'] for r in slow.values()))} | {_shown(spread(ratios), 3)} "
            f"| {', '.join(f'{r:.3f}' for r in ratios)} | {framing[0].mean:.4f} | {framing[1].mean:.4f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: scripts/site-cost.py RESULTS EVEN_PROFILE UNEVEN_PROFILE")
    print(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3]))
