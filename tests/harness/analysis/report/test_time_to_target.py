"""`harness compare`'s finding read from a compare folder (harness/analysis/report/time_to_target.py) and written
(harness/analysis/report/compare.py, compare_figures.py): time to target and its speed-up, the composed estimate's
label wherever it appears, composed beside measured; on fake runs."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from harness.analysis.plan import CompareError, parse_selected_on
from harness.analysis.report.compare import _composition_error_notes, compare_markdown, summary_lines
from harness.analysis.report.compare_figures import target_loss_figure
from harness.analysis.report.compare_files import write_outputs
from harness.analysis.report.markdown import spread_cell
from harness.analysis.report.time_to_target import COMPOSED, MEASURED, _with_composition_error, analyse
from harness.errors import UserError
from tests.harness.analysis.comparing import SPEED, fake_compare, fake_run, row, spec_of

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
    assert ar["utilisation_pairing"] == "" and "utilisation: n/a (local did not run" in compare_markdown(result)
    # 8 evaluation batches x 8 sequences x 128 tokens; five evaluations of 0.5 s each.
    validation = "Validation: 8,192 held-out tokens an evaluation, the same windows for every method and seed; "
    assert validation + "evaluating took 2.5 s a measured run (mean)" in compare_markdown(result)


def test_the_loss_gap_is_taken_at_the_tokens_both_reached(tmp_path):
    spec = spec_of(seeds=(0,), method_steps={"opendiloco": 80})
    for combo in spec.full_sweep().combinations():
        fake_run(tmp_path / "runs", combo, 80 if combo.method == "opendiloco" else 40)
    result = analyse(spec, tmp_path)
    dl = row(result.rows, "opendiloco")
    # At allreduce's 40 steps opendiloco had evaluated at step 40 (its third evaluation, loss 4.1).
    assert dl["loss_vs_allreduce"] == pytest.approx(4.1 / 3.7) and dl["steps"] == 80
    assert "Steps per method (--method-steps): allreduce 40, opendiloco 80." in compare_markdown(result)


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
    text = compare_markdown(result)
    assert "Target validation loss: 4.5 (--target-loss)." in text and "speed-up and loss gap: n/a" in text


def test_composed_rows_carry_their_label_everywhere(tmp_path):
    spec = spec_of(composed=("100mbps",))
    fake_compare(tmp_path, spec, slower={"100mbps": 10.0})
    result = analyse(spec, tmp_path)
    composed = row(result.rows, "opendiloco", "100mbps", COMPOSED)
    # The trajectory of the unshaped runs, the step time of the 100mbps traces (ten times slower).
    assert composed["time_to_target_s"] == pytest.approx(10 * row(result.rows, "opendiloco")["time_to_target_s"])
    assert composed["speedup"] == pytest.approx(3.0, rel=1e-3) and composed["trace_problems"] == ""
    assert set(result.rows["profile"]) == {"1gbps", "100mbps"}  # the unshaped trajectories are not a row
    text = compare_markdown(result)
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
    figure = target_loss_figure(result.curves[result.curves["profile"] == "100mbps"], "100mbps", COMPOSED, 3.9, {
        v: "C0" for v in result.rows["variant"]})  # fmt: skip
    # The legend sits outside the axes (the figure's, not an axes'), every method labelled composed.
    assert all(ax.get_legend() is None for ax in figure.axes)
    labels = [t.get_text() for t in figure.legends[0].get_texts() if not t.get_text().startswith("target")]
    assert labels and all("composed" in label for label in labels)


def test_the_figure_draws_the_control_apart_and_labels_the_target(tmp_path):
    spec = spec_of(methods=("allreduce", "opendiloco", "local"), seeds=(0, 1))
    fake_compare(tmp_path, spec)
    result = analyse(spec, tmp_path)
    colors = {v: "C0" for v in result.rows["variant"]}
    figure = target_loss_figure(result.curves, "1gbps", MEASURED, result.target_loss, colors, result.target_label)
    by_label = {line.get_label(): line for line in figure.axes[0].get_lines()}
    control = next(line for label, line in by_label.items() if label.startswith("local"))
    assert control.get_linestyle() == "--" and "the control, no communication" in control.get_label()
    assert by_label["allreduce (measured, n=2, band ± 1 std)"].get_linestyle() == "-"
    assert "target 4.150 (midway from allreduce's worst final to local's best)" in by_label


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
    assert "| composed ⚠ | allreduce" in compare_markdown(result)
    assert any(line.startswith("100mbps (composed estimate ⚠ trace not steady)") for line in summary_lines(result))


def test_a_profile_measured_and_composed_sets_the_two_side_by_side(tmp_path):
    spec = spec_of(profiles=("100mbps",), composed=("100mbps",))
    fake_compare(tmp_path, spec)
    result = analyse(spec, tmp_path)
    check = result.validation
    assert list(check["method"]) == ["allreduce", "opendiloco"]
    assert check["composed_over_measured"].tolist() == pytest.approx([1.0, 1.0], rel=1e-3)
    assert "Composed vs measured time to target" in compare_markdown(result)
    assert any("composed / measured = 1.000x" in line for line in summary_lines(result))


def test_a_method_that_never_reaches_the_target_gets_no_composed_over_measured_line(tmp_path):
    """local, under the default target, reaches it neither way: its row in the check says n/a, and the summary has no
    "nan s vs nan s" line for it."""
    spec = spec_of(methods=("allreduce", "opendiloco", "local"), profiles=("100mbps",), composed=("100mbps",))
    fake_compare(tmp_path, spec)
    result = analyse(spec, tmp_path)
    assert result.validation.set_index("method").loc["local", "composed_over_measured_n"] == 0
    lines = summary_lines(result)
    assert not [line for line in lines if "nan" in line]
    assert not [line for line in lines if line.startswith("100mbps: local composed")]


# --- the control ---------------------------------------------------------------------------------------------------


def test_a_target_local_reaches_is_flagged_in_the_table_the_summary_and_compare_json(tmp_path):
    """local never communicates: a target it reaches (here 4.75; its losses fall to 4.6) says nothing about
    communication. The default target is halfway between AllReduce's worst final loss (3.7) and local's lowest (4.6):
    4.15, which local does not reach, and nothing is flagged."""
    spec = spec_of(methods=("allreduce", "opendiloco", "local"), seeds=(0, 1))
    fake_compare(tmp_path, spec)
    flag = "local reaches the target (2 of 2 seeds, measured) without ever communicating"
    default = analyse(spec, tmp_path)
    assert default.target_loss == pytest.approx(4.15) and row(default.rows, "local")["reached"] == 0
    assert "Target validation loss: 4.15 (halfway between allreduce's highest" in compare_markdown(default)
    assert flag not in compare_markdown(default) and not any(flag in line for line in summary_lines(default))
    reachable = analyse(spec_of(methods=("allreduce", "opendiloco", "local"), seeds=(0, 1), target_loss=4.75), tmp_path)
    assert row(reachable.rows, "local")["reached"] == 2
    assert flag in compare_markdown(reachable)
    assert f"1gbps: ⚠ {flag}: this target does not measure communication" in "\n".join(summary_lines(reachable))
    write_outputs(reachable, tmp_path, None)
    assert json.loads((tmp_path / "compare.json").read_text())["target"]["reached_by_control"] == ["1gbps"]
    write_outputs(default, tmp_path, None)
    target = json.loads((tmp_path / "compare.json").read_text())["target"]
    assert target["reached_by_control"] == [] and target["rule"].endswith("(4.6: no local run reaches it)")


# --- selection apart from reporting --------------------------------------------------------------------------------


def test_a_row_reported_on_the_seeds_that_chose_its_settings_is_labelled_in_sample(tmp_path):
    """opendiloco's settings chosen on seeds 1 and 2: its rows there are in-sample, allreduce's are not."""
    spec = spec_of(seeds=(0, 1, 2), selected_on={"opendiloco": (1, 2, 7)})
    fake_compare(tmp_path, spec)
    result = analyse(spec, tmp_path)
    assert row(result.rows, "opendiloco")["in_sample_seeds"] == "1,2"
    assert row(result.rows, "allreduce")["in_sample_seeds"] == ""
    markdown = compare_markdown(result)
    labelled = f"{row(result.rows, 'opendiloco')['variant']} (in-sample: seeds 1,2)"
    assert f"| {labelled} |" in markdown and markdown.count("in-sample: seeds") == 1
    assert "in-sample: reported on seeds its settings were chosen on (--selected-on)" in markdown
    assert any(f"{labelled} reached" in line for line in summary_lines(result))
    write_outputs(result, tmp_path, None)
    assert json.loads((tmp_path / "compare.json").read_text())["settings"]["selected_on"] == {"opendiloco": [1, 2, 7]}
    # Reported on seeds no choice saw: nothing is labelled.
    clean = analyse(spec_of(seeds=(0, 1, 2), selected_on={"opendiloco": (5,)}), tmp_path)
    assert not clean.rows["in_sample_seeds"].astype(bool).any()
    assert "in-sample" not in compare_markdown(clean)


def test_selected_on_is_parsed_and_must_name_a_method_that_runs():
    assert parse_selected_on(["dilocox=3,4,5", "opendiloco=1"]) == {"dilocox": (3, 4, 5), "opendiloco": (1,)}
    with pytest.raises(UserError, match="must look like METHOD=SEEDS"):
        parse_selected_on(["dilocox"])
    with pytest.raises(UserError, match="--selected-on names dilocox, which --methods does not run"):
        spec_of(selected_on={"dilocox": (1,)}).validate()


# --- the regime achieved -------------------------------------------------------------------------------------------


def _on_a_regime_link(folder, target_r: float) -> None:
    """What a run on a regime-matched profile records: the R its link was derived for."""
    for summary in folder.rglob("summary.json"):
        summary.write_text(json.dumps({**json.loads(summary.read_text()), "regime_target_r": target_r}))


@pytest.mark.parametrize(("target_r", "flagged"), [(7.0, False), (7.5, False), (8.0, True), (5.0, True)])
def test_the_r_each_run_achieved_is_taken_against_local_in_the_same_study(tmp_path, target_r, flagged):
    """local runs at 8x allreduce's tokens/s on every seed: allreduce's achieved R is 7, whatever the link was
    derived for; more than 10% from the target is flagged."""
    spec = spec_of(methods=("allreduce", "opendiloco", "local"), seeds=(0, 1))
    fake_compare(tmp_path, spec)
    _on_a_regime_link(tmp_path, target_r)
    result = analyse(spec, tmp_path)
    ar, od = row(result.rows, "allreduce"), row(result.rows, "opendiloco")
    assert ar["achieved_r"] == pytest.approx(7.0) and ar["achieved_r_pairing"] == "paired"
    assert od["achieved_r"] == pytest.approx(8000 / 4000 - 1)
    assert row(result.rows, "local")["achieved_r"] == pytest.approx(0.0)
    note = (
        "achieved R (allreduce's step time over local's, minus 1, in this study): 7.0 (range 7.0–7.0) against the "
        f"link's target {target_r:.1f} ({7.0 / target_r - 1:+.0%})"
    )
    markdown = compare_markdown(result)
    assert note in markdown and ("more than 10% off" in markdown) == flagged
    assert any(note in line for line in summary_lines(result))


def test_no_regime_note_on_a_link_not_derived_for_one(tmp_path):
    spec = spec_of(methods=("allreduce", "local"), seeds=(0, 1))
    fake_compare(tmp_path, spec)
    result = analyse(spec, tmp_path)
    assert row(result.rows, "allreduce")["achieved_r"] == pytest.approx(7.0)
    assert "achieved R" not in compare_markdown(result)


# --- the host's other work -----------------------------------------------------------------------------------------


def test_runs_timed_on_a_busy_host_are_named_and_a_quiet_study_says_nothing(tmp_path):
    spec = spec_of(composed=("100mbps",), seeds=(0, 1))
    fake_compare(tmp_path, spec)
    quiet = {"host_other_cpu_share": 0.02}
    for summary in tmp_path.rglob("summary.json"):
        summary.write_text(json.dumps({**json.loads(summary.read_text()), **quiet}))
    assert "host busy" not in compare_markdown(analyse(spec, tmp_path))
    for name, share in (("runs/opendiloco-1gbps-s1", 0.31), ("traces/runs/allreduce-100mbps-s0", 0.12)):
        summary = tmp_path / name / "summary.json"
        summary.write_text(json.dumps({**json.loads(summary.read_text()), "host_other_cpu_share": share}))
    result = analyse(spec, tmp_path)
    note = (
        "⚠ host busy: other processes took more than 10% of the host's CPU during 2 timed run(s) "
        "(opendiloco (local_steps=10) on 1gbps seed 1 31%, allreduce on 100mbps seed 0 (its trace) 12%)"
    )
    assert note in compare_markdown(result)
    write_outputs(result, tmp_path, "harness compare ...")
    assert any(n.startswith(note) for n in json.loads((tmp_path / "compare.json").read_text())["notes"])


# --- the composition's own error in a composed figure --------------------------------------------------------------


def _spread_row(profile, how, method, time_s, tokens_per_s, speedup):
    """A table row whose three figures are each (mean, low, high) over 3 seeds."""
    r = {"profile": profile, "how": how, "method": method, "variant": method}
    for name, (mean, low, high) in (("time_to_target_s", time_s), ("tokens_per_s", tokens_per_s), ("speedup", speedup)):
        r.update({name: mean, f"{name}_n": 3, f"{name}_low": low, f"{name}_high": high})
    return r


def test_a_composed_figure_on_a_link_not_checked_carries_the_error_found_where_it_was():
    """AllReduce composed on a slow link and checked on 100mbps at composed / measured 0.98 (0.95-1.01): the true
    time is composed / r, so its interval runs from 900 / 1.01 to 1,100 / 0.95; its tokens/s from 38 x 0.95 to 42 x
    1.01; DiLoCoX, measured there, divides that time, so its speed-up widens by 1 / r the same way. A composed method
    never checked keeps its seeds' interval and is named."""
    rows = pd.DataFrame(
        [
            _spread_row("100mbps", COMPOSED, "allreduce", (50, 45, 55), (800, 780, 820), (1, 1, 1)),
            _spread_row("slow", COMPOSED, "allreduce", (1000, 900, 1100), (40, 38, 42), (1, 1, 1)),
            _spread_row("slow", MEASURED, "dilocox", (10, 9, 11), (9000, 8000, 1e4), (100, 90, 110)),
            _spread_row("slow", COMPOSED, "cocktail", (20, 18, 22), (2000, 1900, 2100), (50, 45, 55)),
        ]
    )
    validation = pd.DataFrame(
        [
            {"profile": "100mbps", "variant": "allreduce", "composed_over_measured": 0.98,
             "composed_over_measured_low": 0.95, "composed_over_measured_high": 1.01},
        ]
    )  # fmt: skip
    out = _with_composition_error(rows, validation).set_index(["profile", "method"])
    checked, composed = out.loc[("100mbps", "allreduce")], out.loc[("slow", "allreduce")]
    assert checked["composition_error"] == "checked here" and checked["time_to_target_s_high"] == 55
    assert composed["composition_error"] == "included"
    assert (composed["time_to_target_s_low"], composed["time_to_target_s_high"]) == pytest.approx(
        (900 / 1.01, 1100 / 0.95)
    )
    assert (composed["tokens_per_s_low"], composed["tokens_per_s_high"]) == pytest.approx((38 * 0.95, 42 * 1.01))
    measured = out.loc[("slow", "dilocox")]
    assert (measured["speedup_low"], measured["speedup_high"]) == pytest.approx((90 / 1.01, 110 / 0.95))
    assert measured["time_to_target_s_high"] == 11  # its own time is measured: untouched
    unchecked = out.loc[("slow", "cocktail")]
    assert unchecked["composition_error"] == "not checked"
    assert (unchecked["time_to_target_s_low"], unchecked["time_to_target_s_high"]) == (18, 22)
    # Widened on one side more than the other, the cell shows the interval's two ends instead of a ±.
    cell = spread_cell(composed, "time_to_target_s", lambda v: f"{v:,.0f} s", lambda v: f"{v:.2g}")
    assert cell == "1,000 s (891 s–1,158 s)"
    notes = _composition_error_notes(out.reset_index())
    assert "allreduce on slow (composed / measured 0.950x–1.010x)" in notes[0]
    assert notes[1].endswith("the seeds' alone: cocktail on slow.")
