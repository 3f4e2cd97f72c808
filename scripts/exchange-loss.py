#!/usr/bin/env python3
"""DiLoCoX's two exchanges on final validation loss, paired per seed with the gather (`--set exchange=gather`).

Reads one or more sweep folders of dilocox runs (variants labelled as `harness sweep` labels them: dilocox,
dilocox@int8, ...) and prints one markdown table: per variant the options that differ from the gather's (for the
gather: exchange, rank, H_1, adaptive; for a reduce: its wire too), n and seeds, final val loss (mean and 95%
interval over seeds), its difference from the gather's run of the same seed in percent (mean and interval of the
per-seed differences), wire bytes per token and rounds (syncs). Runs of the same variant and seed in two folders
are refused: pass folders that do not overlap.

    scripts/exchange-loss.py results/reference/exchange-loss-bf16-2000

`--pair-with FOLDER` takes the gather to pair with from FOLDER alone and names every variant of the other folders
by its folder (`exchange-fixed-pair-2000/dilocox`), so studies that each hold a gather of their own can all be set
against one:

    scripts/exchange-loss.py --pair-with results/reference/exchange-loss-bf16-2000 \
        results/reference/exchange-fixed-pair-2000
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.analysis.report.aggregates import Spread, spread
from harness.run.folder import find_run_dirs, read_config, read_summary

COMPARED = ("exchange", "reduce_wire", "rank", "local_steps", "adaptive", "power_iterations")
GATHER_SHOWN = ("exchange", "rank", "local_steps", "adaptive")  # the gather's own row: what the others differ from


def variants(folders: list[Path]) -> dict[str, dict[int, tuple[dict, dict]]]:
    """{variant label: {seed: (summary, method options)}} over the folders' ok dilocox runs."""
    found: dict[str, dict[int, tuple[dict, dict]]] = {}
    for run_dir, _ in find_run_dirs(folders):
        summary = read_summary(run_dir)
        if summary.get("status") != "ok" or summary["method"] != "dilocox":
            continue
        label = run_dir.name.split("-")[0]
        seeds = found.setdefault(label, {})
        if summary["seed"] in seeds:
            raise SystemExit(
                f"{run_dir}: a second {label} run of seed {summary['seed']}; pass folders that do not overlap"
            )
        seeds[summary["seed"]] = (summary, read_config(run_dir)["method_options"])
    return found


def shown(s: Spread, digits: int = 3, unit: str = "") -> str:
    if s.n >= 3:
        return f"{s.mean:.{digits}f}{unit} +- {(s.high - s.low) / 2:.{digits}f}{unit}"
    return f"{s.mean:.{digits}f}{unit} (n={s.n})"


def shown_options(options: dict, reference: dict) -> list[str]:
    """What a variant's row names: its exchange, a reduce's wire, and the other options that differ from the gather's
    it is paired with."""
    relevant = [k for k in COMPARED if k != "reduce_wire" or options["exchange"] == "reduce"]
    return [k for k in relevant if k in ("exchange", "reduce_wire") or options[k] != reference[k]]


def is_gather(runs: dict[int, tuple[dict, dict]]) -> bool:
    return all(options["exchange"] == "gather" for _, options in runs.values())


def main(folders: list[Path], pair_with: Path | None = None) -> None:
    if pair_with is None:
        found = variants(folders)
        gathers = [label for label, runs in found.items() if is_gather(runs)]
    else:
        found = variants([pair_with])
        gathers = [label for label, runs in found.items() if is_gather(runs)]
        found = {label: found[label] for label in gathers}
        for folder in folders:
            found |= {f"{folder.name}/{label}": runs for label, runs in variants([folder]).items()}
    if len(gathers) != 1:
        raise SystemExit(f"expected one gather variant to pair with, found {gathers or 'none'}")
    gather = found[gathers[0]]
    print("| variant | options | n | seeds | final val loss | vs gather (paired) | wire B/token | rounds |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    reference = next(iter(gather.values()))[1]
    for label in sorted(found, key=lambda label: (label != gathers[0], label)):
        runs = found[label]
        seeds = sorted(runs)
        options = runs[seeds[0]][1]
        if label == gathers[0]:
            keys, versus = GATHER_SHOWN, "-"
        else:
            keys = shown_options(options, reference)
            loss = {s: runs[s][0]["final_val_loss"] for s in seeds}
            differences = [100 * (loss[s] / gather[s][0]["final_val_loss"] - 1) for s in seeds if s in gather]
            versus = shown(spread(differences), 2, "%")
        differ = ", ".join(f"{k}={options[k]}" for k in keys)
        losses = spread(runs[s][0]["final_val_loss"] for s in seeds)
        wire = spread(runs[s][0]["wire_bytes_per_token"] for s in seeds).mean
        rounds = spread(runs[s][0]["sync_count"] for s in seeds).mean
        print(
            f"| {label} | {differ} | {len(seeds)} | {','.join(map(str, seeds))} | {shown(losses)} | {versus} "
            f"| {wire:.1f} | {rounds:.1f} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, metavar="SWEEP_FOLDER")
    parser.add_argument("--pair-with", type=Path, metavar="FOLDER", help="take the gather to pair with from FOLDER")
    args = parser.parse_args()
    main(args.folders, args.pair_with)
