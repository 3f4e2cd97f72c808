"""A finished run rerun from its folder, its new figures set beside the stored ones (`harness reproduce RUN_DIR`).

The rerun is the run the folder's config.json describes (harness/run/settings.py: its resolved method options,
whatever today's defaults), on inputs that have not changed since (harness/run/inputs.py refuses otherwise). What
may make it differ is said before it starts: another commit, changed code in this checkout, another machine. On
the same machine and code a CPU run's losses repeat exactly (the same seeds, data order and thread count); wire
bytes repeat within TCP's retransmits and framing; tokens/s is a ratio, the machine being shared and noisy.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import UserError
from harness.run.config import RunConfig
from harness.run.folder import RunPaths, UnreadableResults, read_events, read_summary
from harness.run.inputs import check_unchanged
from harness.run.settings import settings_from_file
from harness.run.summary import checkout_commit, code_dirty

# Wire bytes of two runs of the same schedule differ by TCP's retransmits and ACK timing: within this, "same".
WIRE_BYTES_TOLERANCE = 0.001


@dataclass(frozen=True)
class Reproduction:
    """What `harness reproduce` reruns, the figures it compares against, and what may make them differ."""

    run_dir: Path
    config: RunConfig
    stored: dict[str, Any]  # the stored summary.json
    warnings: list[str]


@dataclass(frozen=True)
class Figure:
    """One line of the side-by-side: a figure stored and rerun, and what the difference says."""

    name: str
    stored: str
    new: str
    verdict: str


def prepare(run_dir: Path) -> Reproduction:
    """The rerun of `run_dir`, checked before anything is created; raises UserError in one sentence."""
    paths = RunPaths(run_dir)
    if not paths.config.is_file():
        raise UserError(f"{run_dir} holds no config.json; give a run folder (results/runs/<run_id>)")
    try:
        stored = read_summary(run_dir) if paths.summary.is_file() else None
    except UnreadableResults as err:
        raise UserError(f"{err}; reproduce a run whose summary.json is intact") from None
    if stored is None or stored.get("status") != "ok":
        raise UserError(
            f"{run_dir} holds no finished run (no summary.json, or its status is not ok): there are no figures to "
            "reproduce; `harness run --config` reruns its config all the same"
        )
    given = settings_from_file(run_dir)
    config = RunConfig.build(given.method, given.profile, **given.settings)
    check_unchanged(given.inputs, config.train, paths.config, config.method_source)
    return Reproduction(run_dir, config, stored, _differences(paths))


def _differences(paths: RunPaths) -> list[str]:
    """Why the rerun may not repeat the stored run, each in a sentence."""
    try:
        environment = json.loads(paths.environment.read_text())
    except (OSError, ValueError):
        return [f"{paths.environment} is missing or unreadable: the commit and machine that made the run are unknown"]
    warnings = []
    then, now = environment.get("git_commit"), checkout_commit()
    if then and now and then != now:
        warnings.append(
            f"the run was made at commit {then[:12]} and this checkout is at {now[:12]}: figures may differ where "
            f"the code changed (git checkout {then[:12]} reruns the run's own code)"
        )
    if environment.get("git_dirty"):
        warnings.append("the run was made from changed code (git_dirty): its exact code is not in any commit")
    if code_dirty():
        warnings.append("this checkout's code has changes not in its commit: figures may differ where they touch")
    host = platform.node()
    if environment.get("hostname") and environment["hostname"] != host:
        warnings.append(
            f"the run was made on {environment['hostname']}, this is {host}: losses repeat on the same machine "
            "only (another CPU rounds differently), tokens/s is that machine's"
        )
    return warnings


def figures(reproduction: Reproduction, new: dict[str, Any], new_dir: Path) -> list[Figure]:
    """The stored and rerun figures side by side: losses (identical expected on the same machine), wire bytes
    (within WIRE_BYTES_TOLERANCE), tokens/s (a ratio)."""
    stored = reproduction.stored
    rows = [_step_losses(reproduction.run_dir, new_dir)]
    for key, name in (("initial_val_loss", "initial val loss"), ("final_val_loss", "final val loss")):
        a, b = stored.get(key), new.get(key)
        rows.append(Figure(name, _loss(a), _loss(b), "identical" if a == b else _delta(a, b)))
    a, b = stored.get("wire_bytes"), new.get("wire_bytes")
    if a and b:
        ratio = b / a
        same = abs(ratio - 1) <= WIRE_BYTES_TOLERANCE
        verdict = f"x {ratio:.5f}" + (f" (within {WIRE_BYTES_TOLERANCE:.1%})" if same else " (NOT within 0.1%)")
        rows.append(Figure("wire bytes", f"{a:,}", f"{b:,}", verdict))
    a, b = stored.get("tokens_per_s"), new.get("tokens_per_s")
    if a and b:
        rows.append(Figure("tokens/s", f"{a:,.0f}", f"{b:,.0f}", f"x {b / a:.3f}"))
    return rows


def _step_losses(stored_dir: Path, new_dir: Path) -> Figure:
    """Every rank's per-step training loss, compared step by step."""
    config = RunConfig.load(RunPaths(stored_dir).config)
    ranks = range(config.clusters * config.stages)
    pairs = [
        (step, rank, a, b)
        for rank in ranks
        for step, (a, b) in enumerate(zip(_losses(stored_dir, rank), _losses(new_dir, rank), strict=False))
    ]
    counts = {len(_losses(stored_dir, rank)) for rank in ranks} | {len(_losses(new_dir, rank)) for rank in ranks}
    steps = max(counts, default=0)
    differing = [(step, rank, a, b) for step, rank, a, b in pairs if a != b]
    if not differing and len(counts) == 1:
        return Figure("training loss, every step", f"{steps} steps", f"{steps} steps", "identical on every rank")
    if not differing:
        return Figure("training loss, every step", "", "", f"identical where both have steps (step counts {counts})")
    step, rank, a, b = differing[0]
    return Figure(
        "training loss, every step",
        f"{a:.6f}",
        f"{b:.6f}",
        f"first differs at step {step + 1} on rank {rank}; {len(differing)} of {len(pairs)} (step, rank) differ",
    )


def _losses(run_dir: Path, rank: int) -> list[float]:
    return [e["loss"] for e in read_events(run_dir, rank) if e["kind"] == "step" and "loss" in e]


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.6f}"


def _delta(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "one is missing"
    return f"differs by {b - a:+.6f} ({(b - a) / a:+.3%})"
