"""`harness check` (harness/analysis/gate/check.py) on made-up run folders: each kind of regression fails with its
method, metric and cause, run-to-run noise and another machine's speed pass, and runs made with other settings are
refused."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from harness.analysis.gate.bands import load_baseline, load_stored_runs
from harness.analysis.gate.check import evaluate
from harness.analysis.plan import build_config
from harness.analysis.projection.link_model import LinkModel, default_window_bytes, schedule
from tests.harness.analysis.gate.repeats import (
    COMPUTE_S,
    OPTIONS,
    REFERENCE,
    REPEATS,
    check,
    fake_run,
    step_seconds,
    verdicts,
    write_repeats,
)
from tests.harness.fakeruns import damage

BANDS = 21  # five metrics for each method that communicates, step overhead and loss for local, less UNGATED's one


def failing(output):
    return {key: verdict for key, verdict in verdicts(output).items() if verdict != "holds"}


def test_round_trip_the_reference_runs_pass_their_own_baseline(reference):
    results, path = reference
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 0, out.output
    assert f"{BANDS} of {BANDS} bands hold" in out.output
    found = verdicts(out.output)
    assert len(found) == BANDS and set(found.values()) == {"holds"}
    assert "likely cause" not in out.output


def test_runs_that_recorded_only_their_given_options_are_read_over_todays_defaults_and_marked(reference, tmp_path):
    """Run folders from before runs recorded resolved options (harness/analysis/options.py)."""
    results, path = reference
    old = tmp_path / "old"
    shutil.copytree(results, old)
    for name in ("summary.json", "config.json"):
        for file in old.rglob(name):
            data = json.loads(file.read_text())
            data["method_options"] = data.pop("method_options_given")
            file.write_text(json.dumps(data))
    out = check("--baseline", path, "--results", old)
    assert out.exit_code == 0, out.output
    assert f"{BANDS} of {BANDS} bands hold" in out.output and f"{REPEATS} [options as given]" in out.output


def test_runs_inside_the_noise_pass(reference, tmp_path):
    """Another hour: every method's step overhead a little off, the wire a hair."""
    _, path = reference
    changes = {"allreduce": (1.02, 1, 1), "local": (0.98, 1, 1), "dilocox": (0.97, 1, 1),
               "opendiloco": (1.03, 1, 1), "cocktail": (0.99, 1, 1)}  # fmt: skip
    results = write_repeats(tmp_path / "results", changes, jitter=(1.0, 1.02, 0.97, 1.01, 0.99), wire_overhead=1.055)
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 0, out.output


def test_cocktail_on_another_host_passes_its_step_overhead_is_not_gated(reference, tmp_path):
    """Its step overhead read 22% lower on a second host with the same code (harness/analysis/gate/baseline.py
    UNGATED)."""
    _, path = reference
    results = write_repeats(tmp_path / "results", {"cocktail": (0.78, 1, 1)})
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 0, out.output


def _tokens_per_s(results, method):
    return statistics.median(r.summary["tokens_per_s"] for r in load_stored_runs([results]) if r.method == method)


def test_a_machine_twice_as_fast_or_half_as_fast_passes(reference, tmp_path):
    """The compute's speed cancels out of every metric, though it moves what the former gate held: the ratio of a
    compute-bound method's tokens/s to the link-bound AllReduce's."""
    results, path = reference
    ratios = {}
    for name, factor in (("fast", 0.5), ("slow", 2.0)):
        other = write_repeats(tmp_path / name, compute_s=COMPUTE_S * factor)
        out = check("--baseline", path, "--results", other)
        assert out.exit_code == 0, out.output
        ratios[name] = _tokens_per_s(other, "cocktail") / _tokens_per_s(other, "allreduce")
    reference_ratio = _tokens_per_s(results, "cocktail") / _tokens_per_s(results, "allreduce")
    assert ratios["fast"] > 1.3 * reference_ratio and ratios["slow"] < reference_ratio / 1.3


def test_a_step_15pct_slower_fails_its_step_overhead_naming_the_cause(reference, tmp_path):
    _, path = reference
    results = write_repeats(tmp_path / "results", {"dilocox": (1.15, 1, 1)})
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 1, out.output
    assert failing(out.output) == {("dilocox", "step_overhead"): "ABOVE"}
    text = " ".join(out.output.split())
    assert "- dilocox on 10mbps: step_overhead" in text and "ABOVE its band" in text and "(+15.0% from" in text
    assert "likely cause: compute: the method's own work per step" in text


def test_an_exchange_no_longer_hidden_fails_the_residual(reference, tmp_path):
    """DiLoCoX that waits for each whole exchange at its round's end, where its schedule hides it."""
    _, path = reference
    config = build_config("dilocox", "10mbps", 0, {"steps": 40, **OPTIONS["dilocox"]})
    plan = schedule(config, LinkModel.of(config.profile, 2, window_bytes=default_window_bytes()))
    results = tmp_path / "results"
    write_repeats(results)
    for run in results.glob("dilocox-*"):
        shutil.rmtree(run)
    for i in range(REPEATS):
        fake_run(results, f"dilocox-r{i}", "dilocox", 1.23, 27.3, 3.484, exposed_s=plan.exchange_s / plan.every_steps)
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 1, out.output
    assert failing(out.output) == {("dilocox", "step_time_residual"): "ABOVE"}
    assert "likely cause: link: the run waited on the link longer" in " ".join(out.output.split())


def test_two_percent_more_bytes_fails(reference, tmp_path):
    _, path = reference
    results = write_repeats(tmp_path / "results", {"dilocox": (1, 1.02, 1)})
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 1 and failing(out.output) == {("dilocox", "payload_bytes_per_token"): "ABOVE"}


def test_a_method_that_stops_sending_fails(reference, tmp_path):
    _, path = reference
    results = write_repeats(tmp_path / "results", {"cocktail": (1, 0.001, 1)})
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 1 and failing(out.output)[("cocktail", "payload_bytes_per_token")] == "BELOW"


def test_more_wire_bytes_per_payload_byte_fail(reference, tmp_path):
    """Retransmissions: the method sends what it did, the link carries 10% more."""
    _, path = reference
    results = write_repeats(tmp_path / "results", wire_overhead=1.05 * 1.1)
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 1
    assert {metric for _, metric in failing(out.output)} == {"wire_overhead"}


def test_a_loss_half_a_percent_off_either_way_fails(reference, tmp_path):
    _, path = reference
    for name, factor, verdict in (("worse", 1.005, "ABOVE"), ("better", 0.995, "BELOW")):
        results = write_repeats(tmp_path / name, {"opendiloco": (1, 1, factor)})
        out = check("--baseline", path, "--results", results)
        assert out.exit_code == 1, out.output
        assert failing(out.output) == {("opendiloco", "final_val_loss"): verdict}
    assert "likely cause: loss:" in " ".join(out.output.split())


def test_results_with_other_step_counts_are_refused(reference, tmp_path):
    _, path = reference
    results = write_repeats(tmp_path / "results", steps=60)
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 2, out.output
    text = " ".join(out.output.split())
    assert (
        "none made with the baseline's settings" in text and "steps=60 where the baseline's runs had steps=40" in text
    )


def test_results_with_another_seed_are_refused(reference, tmp_path):
    _, path = reference
    out = check("--baseline", path, "--results", write_repeats(tmp_path / "results", seed=1))
    assert out.exit_code == 2 and "seed=1 where the baseline's runs had seed=0" in " ".join(out.output.split())


def test_other_configurations_beside_the_baselines_are_left_out(reference, tmp_path):
    """A sweep folder may hold more than the gate's runs: only those made with the baseline's settings count."""
    results, path = reference
    runs = load_stored_runs([results])
    fake_run(tmp_path, "dl-60", "dilocox", 9.0, 1, 9.0, steps=60)
    fake_run(tmp_path, "dl-h50", "dilocox", 9.0, 1, 9.0, options={"local_steps": 50})
    outcomes = evaluate(load_baseline(path), [*runs, *load_stored_runs([tmp_path])])
    assert all(o.ok for o in outcomes)
    assert {o.runs for o in outcomes if o.method == "dilocox"} == {str(REPEATS)}


def test_missing_runs_fail_the_check(reference, tmp_path):
    _, path = reference
    for i in range(3):
        fake_run(tmp_path / "results", f"ar{i}", "allreduce", 1.1, 3420.0, 3.662)
    out = check("--baseline", path, "--results", tmp_path / "results")
    assert out.exit_code == 1, out.output
    found = verdicts(out.output)
    assert found[("dilocox", "step_overhead")] == "MISSING" and found[("allreduce", "final_val_loss")] == "holds"
    assert "no successful dilocox runs" in out.output


def test_an_unreadable_run_folder_is_one_sentence_naming_it_and_exit_2(reference, tmp_path):
    """A gate must not pass on the runs that happen to be readable: it names the damaged file instead."""
    _, path = reference
    results = write_repeats(tmp_path / "results")
    bad = results / "dilocox-r1" / "summary.json"
    why = damage(bad, "binary")
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 2 and isinstance(out.exception, SystemExit), out.output
    assert " ".join(out.output.split()) == (
        f"error: {bad}: {why}; run it again (resuming its sweep redoes it) or remove its run folder"
    )


# --- step_overhead against the reference code run on the same machine (experiments/reference_code.py) ---------------

FAKE_COMMIT = "0123456789abcdef0123456789abcdef01234567"
ANOTHER_CPU = 1.2  # every method's step overhead on a machine whose CPU weighs compression differently


def _with_reference_code(path, tmp_path):
    named = tmp_path / "baseline.yaml"
    named.write_text(path.read_text() + f"reference_code: {FAKE_COMMIT}\n")
    return named


def _on_another_cpu(root, changes=None):
    """Runs whose step overhead is ANOTHER_CPU x the reference's (x `changes` for a regression)."""
    shifted = {m: (ANOTHER_CPU, 1, 1) for m in REFERENCE}
    for method, (overhead, payload, loss) in (changes or {}).items():
        shifted[method] = (ANOTHER_CPU * overhead, payload, loss)
    return write_repeats(root, shifted)


def _sweep_folder(root):
    """`root` as a check's --out folder holds its reference code's runs: a sweep folder of its own."""
    (root / "sweep.json").write_text(json.dumps({"settings": {}, "command": None}))
    return root


def test_another_cpu_fails_the_stored_step_overhead_but_holds_against_the_reference_code_run_there(reference, tmp_path):
    _, path = reference
    named = _with_reference_code(path, tmp_path)
    results = _on_another_cpu(tmp_path / "results")
    stored = check("--baseline", named, "--results", results, "--stored-references")
    assert stored.exit_code == 1
    assert {metric for _, metric in failing(stored.output)} == {"step_overhead"}
    here = _on_another_cpu(tmp_path / "reference-code" / "runs")
    out = check("--baseline", named, "--results", results, "--reference-results", _sweep_folder(here.parent))
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    centred = "step_overhead, step_time_residual: each band centred on the reference code (0123456789ab) run on"
    assert centred in text and f"{REPEATS} vs {REPEATS}" in out.output
    shifts = text.split("against the stored references: ")[1].split(" 21 of 21")[0]
    by_metric = dict(part.split(" ", 1) for part in shifts.split("; "))
    assert "dilocox +20.0%" in by_metric["step_overhead"]
    assert set(by_metric) == {"step_overhead", "step_time_residual", "payload_bytes_per_token", "wire_overhead",
                              "final_val_loss"}  # fmt: skip


def test_a_step_15pct_slower_than_the_reference_code_on_the_same_machine_fails(reference, tmp_path):
    """The regression the stored band would miss on a machine 20% the other way."""
    _, path = reference
    named = _with_reference_code(path, tmp_path)
    check_out = tmp_path / "check"
    _on_another_cpu(check_out / "runs", {"dilocox": (1.15, 1, 1)})
    _sweep_folder(check_out)
    _sweep_folder(_on_another_cpu(check_out / "reference-code" / "runs").parent)
    out = check("--baseline", named, "--results", check_out)  # the reference code's runs found beside them
    assert out.exit_code == 1, out.output
    assert failing(out.output) == {("dilocox", "step_overhead"): "ABOVE"}
    assert "(+15.0% from the reference" in " ".join(out.output.split())


def test_without_the_reference_codes_runs_a_method_is_missing_and_without_any_the_stored_references_hold(
    reference, tmp_path
):
    _, path = reference
    named = _with_reference_code(path, tmp_path)
    results = write_repeats(tmp_path / "results")
    here = tmp_path / "reference-code"
    for i in range(3):
        fake_run(here / "runs", f"ar{i}", "allreduce", 1.1, 3420.0, 3.662)
    out = check("--baseline", named, "--results", results, "--reference-results", _sweep_folder(here))
    assert out.exit_code == 1
    found = verdicts(out.output)
    assert found[("dilocox", "step_overhead")] == "MISSING" and found[("allreduce", "step_overhead")] == "holds"
    assert "no step_overhead of the reference code's dilocox runs on this machine" in out.output
    alone = check("--baseline", named, "--results", results)
    assert alone.exit_code == 0, alone.output
    assert "step_overhead and step_time_residual are held to the stored references" in " ".join(alone.output.split())


def test_reference_results_without_results_is_a_usage_error(reference, tmp_path):
    _, path = reference
    out = check("--baseline", path, "--reference-results", tmp_path)
    assert out.exit_code == 2 and "--reference-results goes with --results" in out.output


# --- step_time_residual against the reference code run on the same machine ---------------------------------------

HOST_RESIDUAL_SHIFT = 0.06  # a host whose DiLoCoX waits 6% of a step less than the link model says (0.970 -> ~0.91)


def _dilocox_on_a_host_that_waits_less(root, extra_wait_s=0.0):
    """Every method's repeats, DiLoCoX's waiting HOST_RESIDUAL_SHIFT of its step less on the link (+ extra_wait_s)."""
    write_repeats(root)
    step_s, blocked_s = step_seconds("dilocox", "10mbps", OPTIONS["dilocox"], COMPUTE_S, REFERENCE["dilocox"][0])
    exposed_s = blocked_s - HOST_RESIDUAL_SHIFT * step_s + extra_wait_s
    assert exposed_s > 0
    for run in root.glob("dilocox-*"):
        shutil.rmtree(run)
    for i in range(REPEATS):
        fake_run(root, f"dilocox-r{i}", "dilocox", *REFERENCE["dilocox"], exposed_s=exposed_s)
    return root


def test_a_host_whose_link_wait_reads_lower_fails_the_stored_residual_but_holds_against_the_reference_code(
    reference, tmp_path
):
    """CI's failure on an unchanged main: DiLoCoX's residual 4.5% below the stored reference on another host, the
    reference code's runs there reading the same."""
    _, path = reference
    named = _with_reference_code(path, tmp_path)
    results = _dilocox_on_a_host_that_waits_less(tmp_path / "results")
    stored = check("--baseline", named, "--results", results, "--stored-references")
    assert stored.exit_code == 1
    assert failing(stored.output) == {("dilocox", "step_time_residual"): "BELOW"}
    here = _dilocox_on_a_host_that_waits_less(tmp_path / "reference-code" / "runs")
    out = check("--baseline", named, "--results", results, "--reference-results", _sweep_folder(here.parent))
    assert out.exit_code == 0, out.output
    shifts = " ".join(out.output.split()).split("against the stored references: ")[1]
    residual = next(part for part in shifts.split("; ") if part.startswith("step_time_residual"))
    assert float(residual.split("dilocox ")[1].split("%")[0]) < -5


def test_an_exchange_no_longer_hidden_on_that_host_fails_against_the_reference_code_run_there(reference, tmp_path):
    """The regression the residual is for, on the host where the stored band would sit 6% too high."""
    _, path = reference
    named = _with_reference_code(path, tmp_path)
    config = build_config("dilocox", "10mbps", 0, {"steps": 40, **OPTIONS["dilocox"]})
    plan = schedule(config, LinkModel.of(config.profile, 2, window_bytes=default_window_bytes()))
    check_out = tmp_path / "check"
    _dilocox_on_a_host_that_waits_less(check_out / "runs", extra_wait_s=plan.exchange_s / plan.every_steps)
    _sweep_folder(check_out)
    _sweep_folder(_dilocox_on_a_host_that_waits_less(check_out / "reference-code" / "runs").parent)
    out = check("--baseline", named, "--results", check_out)
    assert out.exit_code == 1, out.output
    assert failing(out.output) == {("dilocox", "step_time_residual"): "ABOVE"}


def test_the_repositorys_baseline_checks_its_own_committed_gate_runs():
    """Refused once ("exchange=None"): runs recorded before an option existed could not be checked again."""
    root = Path(__file__).resolve().parents[4] / "results" / "reference"
    outcomes = evaluate(load_baseline(root / "baseline.yaml"), load_stored_runs([root / "gate"]))
    assert len(outcomes) == 31 and all(outcome.ok for outcome in outcomes), [o.verdict for o in outcomes]
