"""`harness compare`: time to target and its speed-up, the composed estimate (its arithmetic, the steadiness check,
its label wherever it appears), the refusals; a compare through the CLI on fake runs, one real compare, and the fact
the composition rests on: the same seed gives the same per-step losses on two different links."""

from __future__ import annotations

import json
import math
import os

import pandas as pd
import pytest
from click.testing import CliRunner

from harness import cli
from harness.analysis.compare import COMPOSED, MEASURED, CompareError, CompareSpec, analyse, parse_method_steps
from harness.analysis.compare_plots import loss_figure
from harness.analysis.compare_report import markdown, summary_lines, write_outputs
from harness.analysis.composition import MIN_STEADY_STEPS, STEADY_TOLERANCE, Cadence, read_trace
from harness.analysis.sweep import Combination, SweepError, SweepSpec, build_config, run_sweep
from harness.analysis.tables import load_runs
from harness.run import runner
from harness.userns import user_namespaces_work
from tests.harness.fakeruns import write_run
from tests.harness.refusal import assert_refused

CAN_RUN = os.geteuid() == 0 or user_namespaces_work()
LOSSES = {"allreduce": (5.5, 4.5, 4.0, 3.8, 3.7), "opendiloco": (5.5, 4.7, 4.1, 3.9, 3.85)}
SPEED = {"allreduce": 1000.0, "opendiloco": 4000.0, "local": 8000.0}
H10 = {"opendiloco": {"local_steps": 10}}


def fake_run(root, combo, steps: int, slower: float = 1.0, **kwargs) -> None:
    """A fake run of `combo` whose steps take a fixed time: the method's SPEED, 5% faster per seed, / `slower`."""
    method = combo.method
    write_run(
        root, combo.name, method, combo.profile, combo.seed,
        tokens_per_s=SPEED[method] * (1 + 0.05 * combo.seed) / slower,
        val_losses=LOSSES.get(method, (5.5, 5.0, 4.8, 4.7, 4.6)), steps=steps,
        options=H10.get(method), sync_every=10 if method == "opendiloco" else 1, **kwargs,
    )  # fmt: skip


def fake_compare(out, spec: CompareSpec, slower: dict[str, float] | None = None) -> None:
    """Every run `spec` asks for, as fake runs: the full runs at 40 steps, the traces at their own length, `slower`
    times slower on the profiles it names."""
    for combo in spec.full_sweep().combinations():
        fake_run(out / "runs", combo, 40, (slower or {}).get(combo.profile, 1.0))
    if spec.composed:
        lengths = spec.trace_steps()
        for combo in spec.trace_sweep().combinations():
            fake_run(out / "traces" / "runs", combo, lengths[combo.method], (slower or {}).get(combo.profile, 1.0))


def spec_of(methods=("allreduce", "opendiloco"), profiles=("1gbps",), composed=(), seeds=(0, 1, 2), **kw):
    return CompareSpec(methods, profiles, composed, seeds, {"steps": 40}, per_method=H10, **kw)


def row(table: pd.DataFrame, method: str, profile: str = "1gbps", how: str = MEASURED) -> pd.Series:
    return table[(table["method"] == method) & (table["profile"] == profile) & (table["how"] == how)].iloc[0]


# --- time to target, speed-up, loss gap ----------------------------------------------------------------------------


def test_time_to_target_and_its_speed_up_are_paired_per_seed(tmp_path):
    spec = spec_of()
    fake_compare(tmp_path, spec)
    result = analyse(spec, tmp_path)
    # AllReduce's final loss is 3.7 on every seed: the default target is 3.7 x 1.05.
    assert result.target_loss == pytest.approx(3.885) and result.target_source == "allreduce"
    ar, dl = row(result.rows, "allreduce"), row(result.rows, "opendiloco")
    # AllReduce reaches it at the fourth of five evaluations (30 of 40 steps, 2 x 128 x 8 tokens a step), opendiloco
    # at the fifth: 4x the tokens/s, 4/3 the steps.
    seconds = [30 * 2048 / (SPEED["allreduce"] * (1 + 0.05 * s)) for s in (0, 1, 2)]
    assert ar["time_to_target_s"] == pytest.approx(sum(seconds) / 3, rel=1e-3)
    assert (ar["time_to_target_s_n"], ar["reached"], ar["runs"]) == (3, 3, 3)
    assert ar["time_to_target_s_low"] < ar["time_to_target_s"] < ar["time_to_target_s_high"]
    assert dl["speedup"] == pytest.approx(3.0, rel=1e-3) and dl["speedup_pairing"] == "paired"
    assert ar["speedup_pairing"] == "reference"
    assert dl["loss_vs_allreduce"] == pytest.approx(3.85 / 3.7)
    assert ar["utilisation_pairing"] == "" and "utilisation: n/a (local did not run" in markdown(result)


def test_the_loss_gap_is_taken_at_the_tokens_both_reached(tmp_path):
    spec = spec_of(seeds=(0,), method_steps={"opendiloco": 80})
    for combo in spec.full_sweep().combinations():
        fake_run(tmp_path / "runs", combo, 80 if combo.method == "opendiloco" else 40)
    result = analyse(spec, tmp_path)
    dl = row(result.rows, "opendiloco")
    # At allreduce's 40 steps opendiloco had evaluated at step 40 (its third evaluation, loss 4.1).
    assert dl["loss_vs_allreduce"] == pytest.approx(4.1 / 3.7) and dl["steps"] == 80
    assert "Steps per method (--method-steps): allreduce 40, opendiloco 80." in markdown(result)


def test_a_target_no_method_reaches_names_the_closest(tmp_path):
    spec = spec_of(target_loss=2.0)
    fake_compare(tmp_path, spec)
    with pytest.raises(CompareError, match=r"closest was allreduce .*best validation loss of 3.7; the runs are kept"):
        analyse(spec, tmp_path)


def test_without_allreduce_a_given_target_compares_without_speed_ups(tmp_path):
    spec = spec_of(methods=("opendiloco", "local"), target_loss=4.5)
    fake_compare(tmp_path, spec)
    result = analyse(spec, tmp_path)
    dl = row(result.rows, "opendiloco")
    assert dl["speedup_pairing"] == "" and dl["utilisation"] == pytest.approx(0.5)
    text = markdown(result)
    assert "Target validation loss: 4.5 (--target-loss)." in text and "speed-up and loss gap: n/a" in text


# --- the composition ------------------------------------------------------------------------------------------------


def steps_frame(step_s: list[float], sync_steps: set[int]) -> pd.DataFrame:
    elapsed = pd.Series(step_s).cumsum()
    return pd.DataFrame(
        {
            "step": range(len(step_s)),
            "elapsed_s": elapsed,
            "sync_payload_bytes": [100.0 if s in sync_steps else math.nan for s in range(len(step_s))],
        }
    )


def test_composition_adds_the_traces_own_warm_up_then_its_steady_mean_per_step():
    # H = 5: four compute steps of 0.1 s, then the exchange step of 0.6 s; the first round pays 1 s more.
    step_s = [0.1, 0.1, 0.1, 0.1, 1.6] + [0.1, 0.1, 0.1, 0.1, 0.6] * 4
    steps = steps_frame(step_s, {4, 9, 14, 19, 24})
    trace = read_trace(steps, Cadence(5, 0, 5, False), finished=False)
    assert (trace.window_start, trace.window_end, trace.rounds) == (5, 25, 4)
    assert trace.steady_step_s == pytest.approx(0.2) and trace.drift == pytest.approx(0.0)
    assert trace.problem is None
    assert trace.time_to(3) == pytest.approx(0.3)
    # 2.0 s of warm-up round, then 0.2 s a step: exact on a round boundary, a round's mean elsewhere.
    assert trace.time_to(105) == pytest.approx(2.0 + 100 * 0.2)
    assert trace.time_to(25) == pytest.approx(sum(step_s))


def test_a_finish_event_takes_the_last_step_out_of_the_window():
    steps = steps_frame([0.1] * 30, set(range(30)))
    assert read_trace(steps, Cadence(1, 0, 5, False), finished=True).window_end == 29
    # A method that never exchanges counts every step as a round.
    never = steps_frame([0.1] * 30, set()).drop(columns="sync_payload_bytes")
    assert read_trace(never, Cadence(1, 0, 5, False), finished=False).rounds == 25


@pytest.mark.parametrize(
    ("step_s", "expect"),
    [
        # Window: steps 5-29, halves 5-16 and 17-29.
        ([0.1] * 17 + [0.13] * 13, "differ by +30%, more than 10%"),
        ([0.1] * 17 + [0.105] * 13, None),
        ([0.1] * 14, "fewer than 20"),
    ],
)
def test_the_steadiness_check(step_s, expect):
    trace = read_trace(steps_frame(step_s, set(range(len(step_s)))), Cadence(1, 0, 5, False), finished=False)
    assert trace.problem == expect if expect is None else expect in trace.problem
    rounds = read_trace(steps_frame([0.1] * 40, {19, 39}), Cadence(20, 0, 5, False), finished=False)
    assert rounds.problem == "1 whole round(s) after warm-up, fewer than 2"
    assert STEADY_TOLERANCE == 0.10 and MIN_STEADY_STEPS == 20


@pytest.mark.parametrize(
    ("method", "options", "expect"),
    [
        ("allreduce", {}, 25),  # 5 warm-up steps, then 20 one-step rounds
        ("local", {}, 25),
        ("opendiloco", {"local_steps": 10}, 30),  # the slow-start round, then two rounds
        ("cocktail", {}, 31),  # its 10 blocking warm-up steps, then 20, then the step its finish() drains into
        ("dilocox", {"local_steps": 10}, 50),  # adaptive: one round more, as its rounds grow; one for the drain
        ("dilocox", {"local_steps": 10, "overlap": "none", "adaptive": False}, 30),  # blocking: nothing drained
        ("dilocox", {"local_steps": 125}, 200),  # H = 125: never longer than the full run
    ],
)
def test_a_trace_holds_the_warm_up_and_enough_whole_rounds(method, options, expect):
    config = build_config(method, "1gbps", 0, {"steps": 200, **options})
    assert Cadence.of(config).trace_steps(config.train.steps) == expect


def test_composed_rows_carry_their_label_everywhere(tmp_path):
    spec = spec_of(composed=("100mbps",))
    fake_compare(tmp_path, spec, slower={"100mbps": 10.0})
    result = analyse(spec, tmp_path)
    composed = row(result.rows, "opendiloco", "100mbps", COMPOSED)
    # The trajectory of the unshaped runs, the step time of the 100mbps traces (ten times slower).
    assert composed["time_to_target_s"] == pytest.approx(10 * row(result.rows, "opendiloco")["time_to_target_s"])
    assert composed["speedup"] == pytest.approx(3.0, rel=1e-3) and composed["trace_problems"] == ""
    assert set(result.rows["profile"]) == {"1gbps", "100mbps"}  # the unshaped trajectories are not a row
    text = markdown(result)
    assert "| composed | opendiloco" in text and "an estimate, not a measurement" in text
    lines = summary_lines(result)
    assert [line for line in lines if line.startswith("100mbps")] and all(
        "composed estimate" in line for line in lines if line.startswith("100mbps")
    )
    write_outputs(result, tmp_path, "harness compare ...")
    table = pd.read_csv(tmp_path / "compare.csv")
    assert set(table[table["profile"] == "100mbps"]["how"]) == {COMPOSED}
    document = json.loads((tmp_path / "compare.json").read_text())
    hows = {(p["profile"], r["how"]) for p in document["profiles"] for r in p["rows"]}
    assert hows == {("1gbps", MEASURED), ("100mbps", COMPOSED)}
    assert (tmp_path / "figures" / "compare-100mbps-composed.png").is_file()
    figure = loss_figure(result.curves[result.curves["profile"] == "100mbps"], "100mbps", COMPOSED, 3.9, {
        v: "C0" for v in result.rows["variant"]})  # fmt: skip
    labels = [t.get_text() for t in figure.axes[0].get_legend().get_texts() if not t.get_text().startswith("target")]
    assert labels and all("composed" in label for label in labels)


def test_an_unsteady_trace_is_flagged_not_hidden(tmp_path):
    spec = spec_of(composed=("100mbps",), seeds=(0,))
    fake_compare(tmp_path, spec)
    trace = next(tmp_path.glob("traces/runs/allreduce-100mbps-s0/events/rank0.jsonl"))
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    for event in events:  # the second half of the trace's steps take 50% longer
        if event["kind"] != "start" and event.get("step", 0) > 15:
            event["t"] += 0.5 * 2.048 * (event["step"] - 15)
    trace.write_text("".join(json.dumps(e) + "\n" for e in events))
    result = analyse(spec, tmp_path)
    composed = row(result.rows, "allreduce", "100mbps", COMPOSED)
    assert "more than 10%" in composed["trace_problems"]
    assert "| composed ⚠ | allreduce" in markdown(result)
    assert any(line.startswith("100mbps (composed estimate ⚠ trace not steady)") for line in summary_lines(result))


def test_a_profile_measured_and_composed_sets_the_two_side_by_side(tmp_path):
    spec = spec_of(profiles=("100mbps",), composed=("100mbps",))
    fake_compare(tmp_path, spec)
    result = analyse(spec, tmp_path)
    check = result.validation
    assert list(check["method"]) == ["allreduce", "opendiloco"]
    assert check["composed_over_measured"].tolist() == pytest.approx([1.0, 1.0], rel=1e-3)
    assert "Composed vs measured time to target" in markdown(result)
    assert any("composed / measured = 1.000x" in line for line in summary_lines(result))


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
    args = ["compare", "--methods", "allreduce,opendiloco", "--profile", "1gbps", "--composed", "100mbps",
            "--seeds", "0", "--steps", "40", "--set", "opendiloco.local_steps=10",
            "--out", str(tmp_path)]  # fmt: skip
    shown = CliRunner().invoke(cli.main, args)
    assert shown.exit_code == 0, shown.output
    assert calls == [f"{tmp_path.name}/allreduce-1gbps-s0", f"{tmp_path.name}/opendiloco-1gbps-s0",
                     f"{tmp_path.name}/allreduce-unshaped-s0", f"{tmp_path.name}/opendiloco-unshaped-s0",
                     "traces/allreduce-100mbps-s0", "traces/opendiloco-100mbps-s0"]  # fmt: skip
    assert "| composed | allreduce" in shown.output and "opendiloco: local_steps=10" in shown.output
    assert {p.name for p in tmp_path.iterdir()} >= {"compare.json", "compare.md", "compare.csv", "figures", "traces"}
    again = CliRunner().invoke(cli.main, args)
    assert again.exit_code == 0 and len(calls) == 6  # resumed: nothing ran again
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
