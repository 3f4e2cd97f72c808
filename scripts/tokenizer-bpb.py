#!/usr/bin/env python3
"""Bits per byte of held-out text with two tokenizers at equal training wall-clock, paired per seed.

Reads the runs of a sweep over --set tokenizer=bytes,bpe:N (one method, one profile, several seeds) and prints one
markdown table. A run's training clock at an evaluation is the sum of its steps' times before it (evaluation time
left out: both tokenizers evaluate the same number of tokens, but that is not training). Per seed, the budget is the
shorter of the two runs' training times; each run's bits per byte at the budget is interpolated linearly between its
evaluations around it. Then each tokenizer's mean and 95% interval over seeds, and the paired difference
(the second tokenizer minus bytes) with its interval.

    scripts/tokenizer-bpb.py results/reference/tokenizer-bpb-tiny
"""

from __future__ import annotations

import sys
from itertools import accumulate
from pathlib import Path

from harness.analysis.report.aggregates import Spread, spread
from harness.run.folder import find_run_dirs, read_config, read_events, read_summary


def curve(run_dir: Path) -> list[tuple[float, float]]:
    """(training seconds before the evaluation, val bits per byte) at each of the run's evaluations."""
    config = read_config(run_dir)
    events = read_events(run_dir, config["stages"] - 1)
    steps = [e for e in events if e["kind"] == "step"]
    clock = [0.0, *accumulate(e["step_s"] for e in steps)]
    return [(clock[e["step"]], e["val_bpb"]) for e in events if e["kind"] == "eval"]


def at(points: list[tuple[float, float]], t: float) -> float:
    """The curve's value at t, linear between its points (t within them)."""
    for (t0, v0), (t1, v1) in zip(points, points[1:], strict=False):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    raise ValueError(f"{t} s is outside the curve ({points[0][0]} to {points[-1][0]} s)")


def paired(results: Path) -> tuple[list[str], dict[str, list[float]], list[float], dict[str, list[float]]]:
    runs: dict[tuple[int, str], Path] = {}
    for run_dir, _ in find_run_dirs([results]):
        summary = read_summary(run_dir)
        if summary.get("status") == "ok":
            runs[(summary["seed"], read_config(run_dir)["train"]["tokenizer"])] = run_dir
    tokenizers = sorted({tok for _, tok in runs}, key=lambda tok: (tok != "bytes", tok))
    if len(tokenizers) != 2:
        raise SystemExit(f"{results}: expected runs of two tokenizers, found {tokenizers}")
    seeds = sorted(seed for seed, tok in runs if tok == tokenizers[0] and (seed, tokenizers[1]) in runs)
    bpb: dict[str, list[float]] = {tok: [] for tok in tokenizers}
    final: dict[str, list[float]] = {tok: [] for tok in tokenizers}
    budgets = []
    for seed in seeds:
        curves = {tok: curve(runs[(seed, tok)]) for tok in tokenizers}
        budget = min(points[-1][0] for points in curves.values())
        budgets.append(budget)
        for tok, points in curves.items():
            bpb[tok].append(at(points, budget))
            final[tok].append(points[-1][1])
    return tokenizers, bpb, budgets, final


def shown(s: Spread) -> str:
    return f"{s.mean:.3f} [{s.low:.3f}, {s.high:.3f}]" if s.n >= 3 else f"{s.mean:.3f} (n={s.n})"


def main(results: Path) -> None:
    tokenizers, bpb, budgets, final = paired(results)
    first, second = tokenizers
    n = len(budgets)
    print(f"n={n} seeds; training budget per seed {', '.join(f'{b:.1f}' for b in budgets)} s\n")
    print("| tokenizer | val bits/byte at the budget | at its own last step |")
    print("|---|---:|---:|")
    for tok in tokenizers:
        print(f"| {tok} | {shown(spread(bpb[tok]))} | {shown(spread(final[tok]))} |")
    diff = spread(b - a for a, b in zip(bpb[first], bpb[second], strict=True))
    print(f"\n{second} - {first} at the budget, paired per seed: {shown(diff)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
