"""`harness check` (harness/analysis/gate.py) on made-up run folders: realistic regressions fail, run-to-run noise
passes, and runs made with other settings are refused."""

from __future__ import annotations

import json
import shutil

from harness.analysis.bands import load_baseline, load_stored_runs
from harness.analysis.gate import evaluate
from tests.harness.analysis.repeats import check, fake_run, verdicts, write_repeats
from tests.harness.fakeruns import damage


def test_round_trip_the_reference_runs_pass_their_own_baseline(reference):
    results, path = reference
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 0, out.output
    assert "12 of 12 bands hold" in out.output
    found = verdicts(out.output)
    assert len(found) == 12 and set(found.values()) == {"holds"}


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
    assert "12 of 12 bands hold" in out.output and "3 [options as given]" in out.output


def test_runs_inside_the_noise_pass(reference, tmp_path):
    """Another day: every method's tokens/s jittered within the stored spread, bytes and losses a hair off."""
    _, path = reference
    changes = {"allreduce": (1.02, 1.004, 1.0), "local": (0.98, 1, 1), "dilocox": (0.97, 0.995, 1.001),
               "opendiloco": (1.03, 1.003, 0.999), "cocktail": (0.99, 0.997, 1.002)}  # fmt: skip
    results = write_repeats(tmp_path / "results", changes, token_jitter=(1.0, 1.02, 0.97))
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 0, out.output


def test_a_method_whose_throughput_halves_fails(reference, tmp_path):
    _, path = reference
    results = write_repeats(tmp_path / "results", {"opendiloco": (0.5, 1, 1)})
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 1, out.output
    found = verdicts(out.output)
    assert found[("opendiloco", "utilisation")] == "BELOW"
    assert found[("dilocox", "utilisation")] == "holds"
    assert "11 of 12 bands hold" in out.output


def test_a_method_that_stops_sending_fails(reference, tmp_path):
    """cocktail that no longer communicates: ~0 bytes per token, and it trains as fast as local."""
    _, path = reference
    results = write_repeats(tmp_path / "results", {"cocktail": (10500 / 4800, 0.0001, 1)})
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 1, out.output
    found = verdicts(out.output)
    assert found[("cocktail", "wire_bytes_per_token")] == "BELOW"
    assert found[("cocktail", "utilisation")] == "ABOVE"


def test_a_method_that_sends_twice_as_much_fails(reference, tmp_path):
    _, path = reference
    results = write_repeats(tmp_path / "results", {"dilocox": (1, 2, 1)})
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 1 and verdicts(out.output)[("dilocox", "wire_bytes_per_token")] == "ABOVE"


def test_a_loss_above_its_bound_fails(reference, tmp_path):
    _, path = reference
    results = write_repeats(tmp_path / "results", {"opendiloco": (1, 1, 3.70 / 3.58)})
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 1, out.output
    assert verdicts(out.output)[("opendiloco", "final_val_loss")] == "ABOVE"
    # A lower loss is no regression: the loss band has no lower bound.
    better = write_repeats(tmp_path / "better", {"opendiloco": (1, 1, 0.9)})
    assert check("--baseline", path, "--results", better).exit_code == 0


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
    fake_run(tmp_path, "dl-60", "dilocox", 99999, 1, 9.0, steps=60)
    fake_run(tmp_path, "dl-h50", "dilocox", 99999, 1, 9.0, options={"local_steps": 50})
    outcomes = evaluate(load_baseline(path), [*runs, *load_stored_runs([tmp_path])])
    assert all(o.ok for o in outcomes)
    assert {o.runs for o in outcomes if o.method == "dilocox"} == {"3", "3/3"}


def test_missing_runs_fail_the_check(reference, tmp_path):
    _, path = reference
    for i in range(3):
        fake_run(tmp_path / "results", f"ar{i}", "allreduce", 4180, 3586, 3.62)
    out = check("--baseline", path, "--results", tmp_path / "results")
    assert out.exit_code == 1, out.output
    found = verdicts(out.output)
    assert found[("dilocox", "utilisation")] == "MISSING" and found[("allreduce", "final_val_loss")] == "holds"
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
