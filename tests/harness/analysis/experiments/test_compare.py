"""`harness compare` run (harness/analysis/experiments/compare.py): the refusals before anything runs, a compare
through the CLI on fake runs, one real compare, and the fact the composition rests on: the same seed gives the same
per-step losses on two different links."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
from click.testing import CliRunner

from harness import cli
from harness.analysis.experiments import compare as compare_experiment
from harness.analysis.experiments.compare import run_compare
from harness.analysis.experiments.sweep import run_sweep
from harness.analysis.plan import Combination, CompareError, SweepError, SweepSpec, parse_method_steps
from harness.analysis.projection.composition import MIN_TRACE_S
from harness.analysis.report.tables import load_runs
from harness.analysis.report.time_to_target import MEASURED
from harness.run import runner
from harness.userns import user_namespaces_work
from tests.harness.analysis.comparing import fake_run, spec_of
from tests.harness.refusal import assert_refused

CAN_RUN = os.geteuid() == 0 or user_namespaces_work()


# --- refusals ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expect"),
    [
        (spec_of(methods=("allreduce", "nosuch")), "unknown method(s) nosuch"),
        (spec_of(profiles=("nosuch",)), "unknown profile 'nosuch'"),
        (spec_of(composed=("nosuch",)), "unknown profile 'nosuch'"),
        (spec_of(methods=("opendiloco",)), "--methods lacks allreduce"),
        (spec_of(method_steps={"dilocox": 10}), "--method-steps names dilocox"),
        (spec_of(target_loss=-1.0), "--target-loss must be a positive"),
        (spec_of(profiles=()), "name at least one link"),
    ],
)
def test_bad_input_is_refused_before_anything_exists(spec, expect, tmp_path):
    with pytest.raises((CompareError, SweepError)) as refused:
        spec.validate()
    assert expect in str(refused.value)
    assert list(tmp_path.iterdir()) == []


def test_method_steps_must_name_a_positive_count():
    assert parse_method_steps(["dilocox=240"]) == {"dilocox": 240}
    for bad in ("dilocox", "dilocox=0", "=5", "dilocox=x"):
        with pytest.raises(CompareError, match="must look like METHOD=STEPS"):
            parse_method_steps([bad])


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--methods", "allreduce,nosuch", "--profile", "1gbps"], "unknown method(s) nosuch"),
        (["--methods", "allreduce", "--profile", "nosuch"], "unknown profile 'nosuch'"),
        (["--methods", "opendiloco", "--profile", "1gbps"], "--methods lacks allreduce"),
        (["--methods", "allreduce", "--profile", "1gbps", "--method-steps", "allreduce=0"], "METHOD=STEPS"),
    ],
)
def test_the_cli_refuses_in_one_sentence(args, expect, harness_cli, tmp_path):
    result, before, after = harness_cli(["compare", *args, "--out", str(tmp_path / "cmp")])
    assert_refused(result, before, after, [expect])


# --- through the CLI -----------------------------------------------------------------------------------------------


def test_a_compare_runs_both_sweeps_resumes_and_leaves_a_folder_report_reads(tmp_path, monkeypatch):
    calls: list[str] = []

    def run(config, out, on_progress=None):
        calls.append(f"{out.parent.parent.name}/{out.name}")
        combo = Combination(config.method, config.profile.name, config.train.seed)
        assert combo.name == out.name
        fake_run(out.parent, combo, config.train.steps, 10.0 if config.profile.name == "100mbps" else 1.0)
        return json.loads((out / "summary.json").read_text())

    monkeypatch.setattr(runner, "run", run)
    # T_c, which plans the traces' length, is measured once per study (a real `local` run; here a stand-in).
    measured: list[str] = []
    monkeypatch.setattr(compare_experiment, "measure_compute", lambda s, work, p: measured.append(work.name) or 0.01)
    args = ["compare", "--methods", "allreduce,opendiloco", "--profile", "1gbps", "--composed", "100mbps",
            "--seeds", "0", "--steps", "40", "--set", "opendiloco.local_steps=10", "--no-control",
            "--out", str(tmp_path)]  # fmt: skip
    shown = CliRunner().invoke(cli.main, args)
    assert shown.exit_code == 0, shown.output
    assert calls == [f"{tmp_path.name}/allreduce-1gbps-s0", f"{tmp_path.name}/allreduce-unshaped-s0",
                     "traces/allreduce-100mbps-s0", f"{tmp_path.name}/opendiloco-1gbps-s0",
                     f"{tmp_path.name}/opendiloco-unshaped-s0", "traces/opendiloco-100mbps-s0"]  # fmt: skip
    assert "| composed | allreduce" in shown.output and "opendiloco: local_steps=10" in shown.output
    assert {p.name for p in tmp_path.iterdir()} >= {"compare.json", "compare.md", "compare.csv", "figures", "traces"}
    again = CliRunner().invoke(cli.main, args)
    assert again.exit_code == 0 and len(calls) == 6  # resumed: nothing ran again
    assert measured == ["compute"]  # and T_c was not measured again
    report = CliRunner().invoke(cli.main, ["report", str(tmp_path)])
    assert report.exit_code == 0 and "| allreduce" in report.output


# --- real runs -----------------------------------------------------------------------------------------------------

TINY = {"model": "tiny", "batch_size": 2, "seq_len": 32, "throughput_warmup_steps": 2}


@pytest.mark.e2e
@pytest.mark.skipif(not CAN_RUN, reason="needs root or user namespaces for network namespaces")
def test_the_same_seed_gives_the_same_per_step_losses_on_two_links(tmp_path):
    spec = SweepSpec(("allreduce",), ("unshaped", "100mbps"), (0,), settings={**TINY, "steps": 6, "eval_every": 3})
    rows = run_sweep(spec, tmp_path)
    assert [r.status for r in rows] == ["ok", "ok"]
    events = load_runs([tmp_path]).events
    steps = events[events["kind"] == "step"].sort_values(["rank", "step"])
    fast, slow = (steps[steps["profile"] == p] for p in ("unshaped", "100mbps"))
    assert len(fast) == 12 and fast["loss"].tolist() == slow["loss"].tolist()
    # The links differed: the shaped one took longer per step.
    assert slow["step_s"].sum() > fast["step_s"].sum()


@pytest.mark.e2e
@pytest.mark.skipif(not CAN_RUN, reason="needs root or user namespaces for network namespaces")
def test_a_real_compare_through_the_cli(tmp_path):
    out = tmp_path / "cmp"
    args = ["compare", "--methods", "allreduce,local", "--profile", "unshaped", "--seeds", "0", "--model", "tiny",
            "--steps", "8", "--batch-size", "2", "--seq-len", "32", "--eval-every", "4",
            "--throughput-warmup-steps", "2", "--out", str(out)]  # fmt: skip
    shown = CliRunner().invoke(cli.main, args)
    assert shown.exit_code == 0, shown.output
    document = json.loads((out / "compare.json").read_text())
    rows = document["profiles"][0]["rows"]
    assert [(r["method"], r["how"]) for r in rows] == [("allreduce", MEASURED), ("local", MEASURED)]
    assert rows[0]["speedup_pairing"] == "reference" and rows[1]["utilisation_pairing"] == "reference"
    assert "Target validation loss" in (out / "compare.md").read_text()


def test_progress_counts_the_comparisons_runs_across_its_seeds_and_sweeps(tmp_path, monkeypatch):
    """Each seed's sweep counted only its own runs: four runs read "run 1/2, run 2/2" twice. And a method's trace
    runs beside its full runs, after them on the first seed and before them on the next (the order alternates, so a
    steady drift of the host's speed does not bias composed against measured the same way on every seed)."""
    order: list[str] = []

    def run(config, out, on_progress=None):
        order.append(f"{'trace ' if out.parent.parent.name == 'traces' else ''}{out.name}")
        fake_run(out.parent, Combination(config.method, config.profile.name, config.train.seed), config.train.steps)
        return json.loads((out / "summary.json").read_text())

    class Positions:
        def __init__(self):
            self.seen = []

        def started(self, combo, position, total):
            self.seen.append((position, total))

        def progress(self, state):
            pass

        def finished(self, row):
            pass

    monkeypatch.setattr(runner, "run", run)
    monkeypatch.setattr(compare_experiment, "measure_compute", lambda settings, work, progress: 0.01)
    spec = spec_of(seeds=(0, 1), composed=("100mbps",))
    positions = Positions()
    run_compare(spec, tmp_path, observer=positions)
    # Per seed and method: its runs on 1gbps and unshaped (the composed profile's trajectory), and its trace.
    assert positions.seen == [(n, 12) for n in range(1, 13)]
    assert order == [
        "allreduce-1gbps-s0", "allreduce-unshaped-s0", "trace allreduce-100mbps-s0",
        "opendiloco-1gbps-s0", "opendiloco-unshaped-s0", "trace opendiloco-100mbps-s0",
        "trace allreduce-100mbps-s1", "allreduce-1gbps-s1", "allreduce-unshaped-s1",
        "trace opendiloco-100mbps-s1", "opendiloco-1gbps-s1", "opendiloco-unshaped-s1",
    ]  # fmt: skip


def test_compare_runs_the_control_by_default_and_flags_a_target_it_reaches(tmp_path, monkeypatch):
    """local, which never communicates, runs beside the methods unless --no-control: at --target-loss 4.75 it
    reaches the target (its fake losses fall to 4.6), and the table and compare.json say the target does not
    measure communication."""
    calls: list[str] = []

    def run(config, out, on_progress=None):
        calls.append(out.name)
        fake_run(out.parent, Combination(config.method, config.profile.name, config.train.seed), config.train.steps)
        return json.loads((out / "summary.json").read_text())

    monkeypatch.setattr(runner, "run", run)
    args = ["compare", "--methods", "allreduce,opendiloco", "--profile", "1gbps", "--seeds", "0", "--steps", "40",
            "--set", "opendiloco.local_steps=10", "--target-loss", "4.75", "--out", str(tmp_path)]  # fmt: skip
    shown = CliRunner().invoke(cli.main, args)
    assert shown.exit_code == 0, shown.output
    assert calls == ["allreduce-1gbps-s0", "opendiloco-1gbps-s0", "local-1gbps-s0"]
    assert "local reaches the target (1 of 1 seeds, measured) without ever communicating" in shown.output
    assert json.loads((tmp_path / "compare.json").read_text())["target"]["reached_by_control"] == ["1gbps"]


def test_regime_derives_its_link_first_and_composes_only_what_would_not_finish(tmp_path, monkeypatch):
    """--regime: the link comes first (here a stand-in of 5 Mbit/s with 10 ms of compute a step), then every method
    the link model predicts to finish within --measure-limit runs on it end to end; AllReduce (40 steps of 3.5 MB at
    4.7 Mbit/s of goodput: ~4 minutes) is composed from a trace there and its full run on 1gbps."""
    derived: list[str] = []

    def regime_profile(target, settings, out, force, progress):
        progress("deriving")
        path = out / "profiles" / f"{target}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("description: stand-in\ninter_cluster:\n  rate: 5mbit\n")
        path.with_suffix(".json").write_text(json.dumps({"compute_s": 0.01, "target_r": 357.5}))
        derived.append(target)
        return path, None

    calls: list[str] = []

    def run(config, out, on_progress=None):
        calls.append(f"{out.parent.parent.name}/{out.name}")
        # The derived link is a file: its runs name it by path, as the real ones do.
        profile = config.profile.source if config.profile.name == "paper-107b" else config.profile.name
        fake_run(out.parent, Combination(config.method, profile, config.train.seed), config.train.steps)
        return json.loads((out / "summary.json").read_text())

    monkeypatch.setattr(compare_experiment, "regime_profile", regime_profile)
    monkeypatch.setattr(runner, "run", run)
    args = ["compare", "--methods", "allreduce,opendiloco", "--profile", "1gbps", "--regime", "paper-107b",
            "--measure-limit", "1", "--seeds", "0", "--steps", "40", "--set", "opendiloco.local_steps=10",
            "--out", str(tmp_path)]  # fmt: skip
    shown = CliRunner().invoke(cli.main, args)
    assert shown.exit_code == 0, shown.output
    assert derived == ["paper-107b"]
    here = tmp_path.name
    assert calls == [f"{here}/allreduce-1gbps-s0", "traces/allreduce-paper-107b-s0",
                     f"{here}/opendiloco-1gbps-s0", f"{here}/opendiloco-paper-107b-s0",
                     f"{here}/local-1gbps-s0", f"{here}/local-paper-107b-s0"]  # fmt: skip
    document = json.loads((tmp_path / "compare.json").read_text())
    assert document["settings"]["composed_methods"] == {"paper-107b": ["allreduce"]}
    predicted = document["settings"]["predicted_run_s"]
    assert predicted["allreduce"] == pytest.approx(40 * (0.01 + 8 * 3_502_080 / (5e6 * 0.94)), rel=0.01)
    rows = {(r["method"], r["how"]): r for p in document["profiles"] if p["profile"] == "paper-107b" for r in p["rows"]}
    assert set(rows) == {("allreduce", "composed"), ("opendiloco", "measured"), ("local", "measured")}
    # The measured opendiloco's speed-up divides the composed AllReduce's time by its own, paired per seed.
    assert rows[("opendiloco", "measured")]["speedup_pairing"] == "paired"
    assert rows[("opendiloco", "measured")]["speedup"] > 1
    note = "Derived for --regime paper-107b when this study started, from local measured then; composed: allreduce"
    assert note in " ".join(shown.output.split())
    # AllReduce's R on the split link: its composed tokens/s against local's measured ones, against the target.
    allreduce = rows[("allreduce", "composed")]
    assert allreduce["regime_target_r"] == 357.5 and allreduce["achieved_r_pairing"] == "paired"
    assert "achieved R (allreduce's step time over local's, minus 1, in this study)" in " ".join(shown.output.split())
    assert (tmp_path / "figures" / "compare-paper-107b-split.png").is_file()
    again = CliRunner().invoke(cli.main, args)
    assert again.exit_code == 0 and len(calls) == 6 and derived == ["paper-107b"] * 2  # resumed: the link reused


def test_measure_limit_without_regime_is_refused():
    with pytest.raises(CompareError, match="--measure-limit applies only with --regime"):
        spec_of(measure_limit_s=60.0).validate()


def test_traces_are_planned_long_enough_from_the_compute_measured_when_the_study_started(tmp_path, monkeypatch):
    """A composed method's trace lasts MIN_TRACE_S at its predicted step time on the composed link: T_c measured once
    (OUT/compute/compute.json) plus the link's time for its payload. AllReduce on 100 Mbit/s at 50 ms of compute:
    3,502,080 bytes at 94 Mbit/s of goodput, 0.35 s a step, so 87 one-step rounds after its 5 warm-up steps where
    the rounds' minimum alone gave 25."""
    measured: list[str] = []
    monkeypatch.setattr(
        compare_experiment, "measure_compute", lambda settings, work, progress: measured.append(work.name) or 0.05
    )
    spec = dataclasses.replace(spec_of(composed=("100mbps",), seeds=(0,)), settings={"steps": 2000})
    planned = compare_experiment.with_trace_step_s(spec, tmp_path)
    step_s = 0.05 + 8 * 3_502_080 / (100e6 * 0.94)
    assert planned.trace_step_s["allreduce"] == pytest.approx(step_s, rel=0.02)
    assert planned.trace_steps()["allreduce"] == pytest.approx(5 + math.ceil(MIN_TRACE_S / step_s), abs=2)
    assert spec.trace_steps()["allreduce"] == 25
    # Resumed: the study's own T_c is reused, not measured again, so its traces keep their length.
    again = compare_experiment.with_trace_step_s(spec, tmp_path)
    assert measured == ["compute"] and again.trace_step_s == planned.trace_step_s
    assert json.loads((tmp_path / "compute" / "compute.json").read_text()) == {"compute_s": 0.05}
