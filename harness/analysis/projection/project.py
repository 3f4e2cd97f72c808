"""`harness project`: predicted tokens/s and wire bytes per token of a method, from three parts kept apart.

(a) compute: seconds per training step that are not spent waiting on the link (forward, backward, optimizer, the
    method's own compression), per step, `compute_s`. Measured on this machine: the mean over a run's steps after
    its throughput warm-up of step_s - sync_blocked_s on rank 0, from a run of the same method and settings (on an
    unshaped link, where waiting is short, it is measured apart from it). For a model this machine cannot train, from
    a target accelerator: 6 N tokens per site per step / (accelerators x peak FLOP/s x MFU).
(b) the link and (c) the schedule: harness/analysis/projection/link_model.py's module doc (LinkModel, Schedule).

Assumptions (each printed with the prediction): a method that adapts its rounds keeps its first round's schedule
throughout (its plan promises that adaptation only lowers its bytes per step from there); a method's compression time
is in compute_s as measured, and taken as part of the FLOPs scaling (or ignored) for an accelerator; pipeline stages
within a site do not change what a site's uplink carries (the whole model crosses it, stage by stage); one exchange
at a time on the link.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.analysis.options import run_options
from harness.analysis.projection.link_model import (
    DEFAULT_EFFICIENCY,
    Compute,
    LinkModel,
    ProjectionError,
    Schedule,
    default_window_bytes,
    schedule,
)
from harness.net.topology import Topology
from harness.run.config import RunConfig, check_finite_options
from harness.run.folder import RunPaths, find_run_dirs, read_events, read_summary
from harness.units import format_rate
from trainers.models import count_parameters, get_model_config
from trainers.registry import check_applicable, resolved_options

# harness project --validate: what a prediction must come within (the acceptance).
VALIDATION_TOLERANCE = 0.15


@dataclass(frozen=True)
class Prediction:
    method: str
    model: str
    profile: str
    clusters: int
    tokens_per_step: int
    compute: Compute
    link: LinkModel
    schedule: Schedule

    @property
    def step_s(self) -> float:
        return self.schedule.step_s(self.compute.step_s, self.compute.hide_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    def run_tokens_per_s(self, steps: int, warmup_steps: int) -> float:
        """Tokens/s as a run of `steps` steps measures it: over its steps after the throughput warm-up, with the
        method's warm-up and the first exchange's slow start where they fall inside."""
        window_s = self.schedule.window_s(self.compute.step_s, self.compute.hide_s, steps, warmup_steps)
        return (steps - warmup_steps) * self.tokens_per_step / window_s

    @property
    def wire_bytes_per_token(self) -> float:
        """Payload bytes all sites send per token (the kernel's counters add TCP/IP headers on top)."""
        return self.clusters * self.schedule.payload_bytes / self.schedule.every_steps / self.tokens_per_step

    @property
    def compute_ceiling_tokens_per_s(self) -> float:
        return self.tokens_per_step / self.compute.step_s

    def record(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "model": self.model,
            "profile": self.profile,
            "clusters": self.clusters,
            "tokens_per_step": self.tokens_per_step,
            "compute": dataclasses.asdict(self.compute),
            "link": {**dataclasses.asdict(self.link), "goodput_bps": self.link.goodput_bps},
            "schedule": dataclasses.asdict(self.schedule),
            "step_s": self.step_s,
            "predicted_tokens_per_s": self.tokens_per_s,
            "compute_ceiling_tokens_per_s": self.compute_ceiling_tokens_per_s,
            "wire_bytes_per_token": self.wire_bytes_per_token,
            "assumptions": ASSUMPTIONS,
        }

    def describe(self) -> list[str]:
        link, sched, compute = self.link, self.schedule, self.compute
        rate = "unshaped" if link.rate_bps is None else format_rate(link.rate_bps)
        goodput = "unbounded" if math.isinf(link.goodput_bps) else format_rate(link.goodput_bps)
        return [
            f"{self.method} · model {self.model} · profile {self.profile} · {self.clusters} sites · "
            f"{self.tokens_per_step:,} tokens per step",
            f"compute: {compute.step_s:.4g} s per step, {compute.hide_s:.4g} s of it forward and backward "
            f"({compute.source})",
            f"link: slowest site {rate}, RTT {1000 * link.rtt_s:g} ms, goodput {goodput} "
            f"(efficiency {link.efficiency:g}, TCP window {link.window_bytes:,} B)",
            f"exchange: {sched.payload_bytes:,} B from each site every {sched.every_steps} step(s), "
            f"{sched.exchange_s:.4g} s on the link, beside {sched.hidden_steps:g} step(s) of compute: "
            f"{sched.blocked_s(compute.hide_s):.4g} s waited per exchange"
            + (" (its first round's: the method adapts its rounds)" if sched.adaptive else ""),
            f"predicted: {self.tokens_per_s:,.1f} tokens/s ({self.step_s:.4g} s per step; compute ceiling "
            f"{self.compute_ceiling_tokens_per_s:,.1f}), {self.wire_bytes_per_token:,.4g} wire bytes per token",
        ]


ASSUMPTIONS = (
    "steady state: no warm-up, no first-exchange slow start",
    "a method that adapts its rounds at its first round's schedule throughout (adaptation only lowers its bytes)",
    "the whole model crosses each site's uplink once per exchange, whatever the pipeline stages",
    "one exchange at a time on the link; loss and jitter not modelled",
)


def predict(config: RunConfig, tokens_per_step: int, compute: Compute, link: LinkModel) -> Prediction:
    sched = schedule(config, link)
    return Prediction(
        config.method, config.train.model, config.profile.name, config.clusters, tokens_per_step, compute, link, sched
    )


@dataclass(frozen=True)
class Accelerator:
    """What each site computes with, for a model this machine cannot train."""

    peak_tflops: float  # per accelerator, in the training dtype
    per_site: int
    mfu: float  # model FLOPs utilisation: the share of peak that training reaches

    def compute(self, model: str, tokens_per_site_step: int) -> Compute:
        """6 N FLOPs per token (forward and backward) over what a site's accelerators deliver."""
        flops = 6 * count_parameters(get_model_config(model)) * tokens_per_site_step
        step_s = flops / (self.per_site * self.peak_tflops * 1e12 * self.mfu)
        source = f"{self.per_site} x {self.peak_tflops:g} TFLOP/s at MFU {self.mfu:g} per site, 6 N FLOPs per token"
        return Compute(step_s, step_s, source)


def resolve_compute(
    method: str,
    options: dict[str, Any],
    model: str,
    clusters: int,
    tokens_per_step: int,
    compute_from: Sequence[Path] = (),
    compute_s: float | None = None,
    accelerator: Accelerator | None = None,
) -> Compute:
    """Given, from an accelerator, or measured on this machine by runs of the same method and options (any model
    and batch: scaled by N x tokens per site, the FLOPs)."""
    if sum(x is not None and x != () for x in (compute_s, accelerator, tuple(compute_from))) != 1:
        raise ProjectionError(
            "say where compute comes from, once: --compute-from RUNS (this method's runs on this machine), "
            "--compute-s SECONDS per step, or --accelerator-tflops with --accelerators-per-site and --mfu"
        )
    if compute_s is not None:
        if not (isinstance(compute_s, (int, float)) and math.isfinite(compute_s) and compute_s > 0):
            raise ProjectionError(f"--compute-s must be a positive number of seconds, got {compute_s}")
        return Compute(compute_s, compute_s, "given (--compute-s)")
    per_site = tokens_per_step // clusters
    if accelerator is not None:
        return accelerator.compute(model, per_site)
    # The same variant: every option equal, defaults included (harness/analysis/options.py).
    wanted = resolved_options(method, options)
    per_flop = []
    for run_dir, summary, _ in ok_runs(compute_from):
        if summary["method"] != method or run_options(summary).resolved != wanted:
            continue
        run_tokens = summary["tokens"] // summary["steps"] // summary["clusters"]
        per_flop.append(measured_compute(run_dir).scaled(1 / (summary["param_count"] * run_tokens), ""))
    if not per_flop:
        raise ProjectionError(
            f"no successful {method} run with these options under {', '.join(map(str, compute_from))} to measure "
            "compute from; run it there (e.g. harness run --profile unshaped) or pass --compute-s"
        )
    scale = count_parameters(get_model_config(model)) * per_site
    source = f"measured on this machine: mean of {len(per_flop)} run(s), scaled by N x tokens per site"
    return Compute(
        statistics.fmean(c.step_s for c in per_flop) * scale, statistics.fmean(c.hide_s for c in per_flop) * scale,
        source,
    )  # fmt: skip


def measured_compute(run_dir: Path) -> Compute:
    """Means over rank 0's steps after the throughput warm-up: step_s - sync_blocked_s, and compute_s (forward and
    backward) (module doc, (a))."""
    warmup = RunConfig.load(RunPaths(run_dir).config).train.throughput_warmup_steps
    steps = [e for e in read_events(run_dir, 0) if e["kind"] == "step" and e["step"] >= warmup]
    if not steps:
        raise ProjectionError(f"{run_dir} has no steps after its warm-up to measure compute from; use a longer run")
    return Compute(
        statistics.fmean(e["step_s"] - e.get("sync_blocked_s", 0.0) for e in steps),
        statistics.fmean(e["compute_s"] for e in steps),
        f"measured: {run_dir.name}",
    )


def mean_compute(measurements: Sequence[Compute]) -> Compute:
    return Compute(
        statistics.fmean(c.step_s for c in measurements), statistics.fmean(c.hide_s for c in measurements),
        f"mean of {len(measurements)} run(s)",
    )  # fmt: skip


def settings_key(summary: dict[str, Any], config: RunConfig) -> tuple:
    """What a compute measurement must share with the run it predicts: method and options, model, shape, batch."""
    options = json.dumps(run_options(summary).resolved, sort_keys=True)
    train = config.train
    return (summary["method"], options, summary["model"], summary["clusters"], train.batch_size, train.seq_len)


def ok_runs(paths: Sequence[Path]) -> list[tuple[Path, dict[str, Any], RunConfig]]:
    """(folder, summary, config) of every successful run under `paths` (run folders or folders of them)."""
    found = []
    for run_dir, _ in find_run_dirs(paths):
        summary = read_summary(run_dir)
        if summary["status"] == "ok":
            found.append((run_dir, summary, RunConfig.load(RunPaths(run_dir).config)))
    return found


def validate(results: Sequence[Path], compute_from: Sequence[Path]) -> list[dict[str, Any]]:
    """Predicted vs measured tokens/s for every (method, options, model, profile) of the successful runs in
    `results`; compute from the runs in `compute_from` with the same method, options, model, shape and batch (their
    mean), which should be other runs than the predicted ones (on an unshaped link).

    Each row also predicts from the measured runs' own compute (`own_*`): that tests the link and schedule alone,
    the part a projection to other sites and links carries over (compute there comes from an accelerator). Where
    ranks share cores, compute differs between runs by more than a fast link adds, and only that column can tell.
    `link_share` is the predicted part of a step spent waiting on the link: a row near 0 tests the link weakly."""
    computes: dict[tuple, list[Compute]] = {}
    for run_dir, summary, config in ok_runs(compute_from):
        computes.setdefault(settings_key(summary, config), []).append(measured_compute(run_dir))
    groups: dict[tuple, list[tuple[dict, RunConfig, Compute]]] = {}
    for run_dir, summary, config in ok_runs(results):
        run = (summary, config, measured_compute(run_dir))
        groups.setdefault((settings_key(summary, config), summary["profile"]), []).append(run)
    rows = []
    # model, profile, method, sites, options
    in_order = sorted(groups.items(), key=lambda kv: (kv[0][0][2], kv[0][1], kv[0][0][0], kv[0][0][3], kv[0][0][1]))
    for (key, profile_name), runs in in_order:
        if key not in computes:
            raise ProjectionError(
                f"no compute measurement for {key[0]} {key[1]} on model {key[2]} ({key[3]} clusters, batch {key[4]}) "
                "under --compute-from; run that method with those settings on the unshaped profile there"
            )
        summary, config, _ = runs[0]
        compute, own = mean_compute(computes[key]), mean_compute([c for _, _, c in runs])
        link = LinkModel.of(config.profile, config.clusters, window_bytes=default_window_bytes())
        prediction = predict(config, summary["tokens"] // summary["steps"], compute, link)
        own_prediction = predict(config, summary["tokens"] // summary["steps"], own, link)
        window = (config.train.steps, config.train.throughput_warmup_steps)
        predicted, own_predicted = prediction.run_tokens_per_s(*window), own_prediction.run_tokens_per_s(*window)
        measured = [s["tokens_per_s"] for s, _, _ in runs]
        mean = statistics.fmean(measured)
        rows.append(
            {
                "model": summary["model"],
                "profile": profile_name,
                "rtt_ms": 1000 * prediction.link.rtt_s,
                "clusters": config.clusters,
                "method": summary["method"],
                "options": key[1],
                "n": len(measured),
                "measured_tokens_per_s": mean,
                "measured_min": min(measured),
                "measured_max": max(measured),
                "predicted_tokens_per_s": predicted,
                "error": predicted / mean - 1,
                "steady_state_tokens_per_s": prediction.tokens_per_s,
                "compute_step_s": compute.step_s,
                "compute_hide_s": compute.hide_s,
                "compute_runs": len(computes[key]),
                "own_compute_step_s": own.step_s,
                "own_predicted_tokens_per_s": own_predicted,
                "own_error": own_predicted / mean - 1,
                "link_share": 1 - own.step_s / own_prediction.step_s,
            }
        )
    return rows


def project(
    method: str,
    model: str,
    profile: str,
    clusters: int,
    settings: dict[str, Any],
    compute_from: Sequence[Path] = (),
    compute_s: float | None = None,
    accelerator: Accelerator | None = None,
    efficiency: float = DEFAULT_EFFICIENCY,
    window_bytes: int | None = None,
) -> Prediction:
    """The prediction `harness project` prints: settings are the run's flat settings (batch_size, seq_len and the
    method's options), checked as a run would check them, so a projection is of a run that could be made."""
    config = RunConfig.build(method, profile, clusters=clusters, model=model, **settings)
    Topology(clusters, 1)
    config.profile.check_sites(clusters)
    try:
        # A setting the method refuses, or ignores under the others, is named first, as a run names it.
        check_applicable(method, config.method_config, config.method_options)
    except ValueError as err:
        raise ProjectionError(str(err)) from None
    check_finite_options(config.method_options)
    if config.profile.trace is not None:
        raise ProjectionError(
            f"profile {config.profile.name!r} replays a trace whose rate changes during a run, and the link model "
            "takes one rate; project on a profile with the fixed rate you want to know about"
        )
    try:
        config.train.validate()
        get_model_config(config.train.model)
    except ValueError as err:
        raise ProjectionError(str(err)) from None
    if not 0 < efficiency <= 1:
        raise ProjectionError(f"--efficiency must be in (0, 1], got {efficiency}")
    if window_bytes is not None and window_bytes < 1:
        raise ProjectionError(f"--window-bytes must be a positive number of bytes, got {window_bytes}")
    if accelerator is not None and not (
        accelerator.peak_tflops > 0 and accelerator.per_site >= 1 and 0 < accelerator.mfu <= 1
    ):
        raise ProjectionError(
            "--accelerator-tflops must be positive, --accelerators-per-site at least 1 and --mfu in (0, 1]"
        )
    model_cfg = get_model_config(config.train.model)
    tokens_per_step = clusters * config.train.batch_size * (config.train.seq_len or model_cfg.max_seq_len)
    link = LinkModel.of(
        config.profile, clusters, efficiency=efficiency, window_bytes=window_bytes or default_window_bytes()
    )
    # Before compute is looked for: a method that declares no exchange has nothing to project.
    sched = schedule(config, link)
    compute = resolve_compute(
        method, config.method_options, model_cfg.name, clusters, tokens_per_step, compute_from, compute_s, accelerator
    )
    return Prediction(method, model_cfg.name, config.profile.name, clusters, tokens_per_step, compute, link, sched)
