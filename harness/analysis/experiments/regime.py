"""Regime matching's runs: T_c measured with a `local` run, then the derived link corrected closed-loop against short
`local` and `allreduce` runs on it (the derivation, and why it needs correcting: harness/analysis/projection/regime.py).

Closed loop: short `local` and `allreduce` runs on the derived link measure the achieved R, and the rate is corrected
(T_comm ~ 1 / rate) until the achieved R is within REGIME_TOLERANCE of the target, at most MAX_CORRECTIONS times.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from harness.analysis.plan import build_config
from harness.analysis.projection.regime import (
    REGIME_TOLERANCE,
    Probe,
    Regime,
    RegimeError,
    get_target,
    measure_compute_s,
    write_regime_profile,
)
from harness.run import runner
from harness.run.folder import RunFolder
from harness.units import format_rate
from trainers.models import count_parameters, get_model_config

# T_c: enough `local` steps that the median is steady (8 steps read 18.9 ms where the sweep's runs stepped in 13 ms).
MEASURE_STEPS = 40
MEASURE_WARMUP_STEPS = 5
MAX_CORRECTIONS = 4
PROBE_LOCAL_STEPS = 30
PROBE_ALLREDUCE_STEPS = 6
PROBE_WARMUP_STEPS = 2


def check_request(target_name: str, settings: Mapping[str, Any]) -> None:
    """A known target, and settings a measurement run accepts; raises UserError before anything runs."""
    get_target(target_name)
    build_config("local", "unshaped", 0, settings)


def _fresh(run_dir: Path) -> Path:
    """A measurement is redone from scratch: an earlier one (or its staging folder) would block the runner."""
    for stale in (run_dir, RunFolder(run_dir).staging):
        if stale.exists():
            shutil.rmtree(stale)
    return run_dir


def _run(method: str, profile: str, settings: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
    summary = runner.run(build_config(method, profile, 0, settings), _fresh(run_dir))
    if summary["status"] != "ok":
        raise RegimeError(f"the {method} measurement failed: {summary['failure']} (see {summary['results_dir']})")
    return summary


def probe(rate_bps: int, settings: Mapping[str, Any], work_dir: Path, index: int) -> Probe:
    """Achieved R on a link of rate_bps: short `local` and `allreduce` runs, tokens/s after their warm-up."""
    profile = work_dir / f"probe{index}.yaml"
    profile.write_text(yaml.safe_dump({"description": "regime probe", "inter_cluster": {"rate": f"{rate_bps}bit"}}))
    short = {**settings, "eval_every": 10**6, "eval_batches": 1, "throughput_warmup_steps": PROBE_WARMUP_STEPS}
    local = _run("local", str(profile), {**short, "steps": PROBE_LOCAL_STEPS}, work_dir / f"probe{index}-local")
    allreduce = _run(
        "allreduce", str(profile), {**short, "steps": PROBE_ALLREDUCE_STEPS}, work_dir / f"probe{index}-allreduce"
    )
    return Probe(rate_bps, local["tokens_per_s"], allreduce["tokens_per_s"])


def closed_loop(
    regime: Regime, measure: Callable[[int, int], Probe], progress: Callable[[str], None] = lambda line: None
) -> Regime:
    """Correct the rate until the achieved R is within REGIME_TOLERANCE of the target (at most MAX_CORRECTIONS
    probes; the closest one is kept if none is). T_comm scales as 1 / rate, so rate *= achieved R / target R.
    `progress` is told of each probe as it starts and ends."""
    target_r = regime.target.comm_to_compute
    probes: list[Probe] = []
    rate = regime.open_loop_rate_bps
    for index in range(MAX_CORRECTIONS):
        progress(
            f"probe {index + 1} of at most {MAX_CORRECTIONS}: {PROBE_LOCAL_STEPS} local and {PROBE_ALLREDUCE_STEPS} "
            f"allreduce steps on {format_rate(rate)} (~{_probe_allreduce_s(regime, rate):,.0f} s of allreduce)"
        )
        probes.append(measure(rate, index))
        progress(f"probe {index + 1}: achieved R {probes[-1].achieved_r:.1f}, target {target_r:.1f}")
        if abs(probes[-1].achieved_r / target_r - 1) <= REGIME_TOLERANCE:
            break
        rate = round(rate * probes[-1].achieved_r / target_r)
    best = min(probes, key=lambda p: abs(p.achieved_r / target_r - 1))
    # The kept probe last: rate_bps and achieved_r read it.
    return dataclasses.replace(regime, probes=(*[p for p in probes if p is not best], best))


def _probe_allreduce_s(regime: Regime, rate_bps: int) -> float:
    return PROBE_ALLREDUCE_STEPS * (regime.compute_s + 8 * regime.payload_bytes / rate_bps)


def measure_compute(
    settings: Mapping[str, Any], work_dir: Path, progress: Callable[[str], None] = lambda line: None
) -> float:
    """T_c, a step's compute time with `settings`: the median step of a `local` run on an unshaped link, in
    work_dir/measure-compute."""
    work_dir.mkdir(parents=True, exist_ok=True)
    measure = {
        **settings,
        "steps": MEASURE_STEPS,
        "throughput_warmup_steps": MEASURE_WARMUP_STEPS,
        "eval_every": MEASURE_STEPS,
        "eval_batches": 1,
    }
    config = build_config("local", "unshaped", 0, measure)
    progress(f"measuring the compute time per step: {MEASURE_STEPS} local steps on an unshaped link")
    summary = _run("local", "unshaped", measure, work_dir / "measure-compute")
    return measure_compute_s(Path(summary["results_dir"]), config.stages, config.clusters, MEASURE_WARMUP_STEPS)


def derive_regime(
    target_name: str,
    settings: Mapping[str, Any],
    work_dir: Path,
    progress: Callable[[str], None] = lambda line: None,
) -> Regime:
    """Measure T_c with a `local` run in work_dir/measure-compute, derive the link (module doc), then correct it
    closed-loop against short `local` and `allreduce` runs on it; writes work_dir/regime.json. `progress` is told
    of each measurement, one line each (the probes on a slow link take minutes)."""
    target = get_target(target_name)
    compute_s = measure_compute(settings, work_dir, progress)
    config = build_config("local", "unshaped", 0, settings)
    model = get_model_config(config.train.model)
    seq_len = config.train.seq_len or model.max_seq_len
    regime = Regime(
        target=target,
        model=model.name,
        clusters=config.clusters,
        param_count=count_parameters(model),
        compute_s=compute_s,
        tokens_per_step=config.clusters * config.train.batch_size * seq_len,
    )
    progress(f"T_c = {compute_s * 1000:.1f} ms a step; derived link {format_rate(regime.open_loop_rate_bps)}")
    regime = closed_loop(regime, lambda rate, index: probe(rate, settings, work_dir, index), progress)
    (work_dir / "regime.json").write_text(json.dumps(regime.record(), indent=2) + "\n")
    return regime


def regime_profile(
    target_name: str,
    settings: Mapping[str, Any],
    out: Path,
    force: bool,
    progress: Callable[[str], None] = lambda line: None,
) -> tuple[Path, Regime | None]:
    """A sweep's regime profile, OUT/profiles/<target>.yaml: derived once, then reused so a resumed sweep keeps
    the link its earlier runs had; returns the path and the fresh derivation (None when reused)."""
    path = out / "profiles" / f"{get_target(target_name).name}.yaml"
    if path.is_file() and not force:
        return path, None
    regime = derive_regime(target_name, settings, out / "regime", progress)
    return write_regime_profile(regime, path), regime
