"""The baseline file (harness/analysis/gate/bands.py): reading and validating one, the runs it needs, and the run
folders it is held against."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml

from harness.analysis.gate.bands import METRICS, Band, BaselineError, load_baseline, load_stored_runs, needed_runs
from harness.analysis.gate.baseline import UNGATED
from harness.run.folder import UnreadableResults
from tests.harness.analysis.gate.repeats import STEPS, check, fake_run
from tests.harness.fakeruns import damage


def baseline_file(tmp_path, band=None, **run):
    data = {
        "run": {"model": "tiny", "steps": STEPS, "eval_every": 20, "seed": 0, **run},
        "checks": [
            {
                "method": "opendiloco",
                "profile": "100mbps",
                "step_overhead": band or {"reference": 1.07, "noise": 0.01, "tolerance": 0.06},
            },
        ],  # fmt: skip
    }
    path = tmp_path / "baseline.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_band_is_a_factor_either_way():
    band = Band("step_overhead", reference=0.8, noise=0.05, tolerance=0.25)
    assert (band.lower, band.upper) == (pytest.approx(0.64), pytest.approx(1.0))
    assert band.holds(0.64) and band.holds(1.0) and not band.holds(0.4) and not band.holds(1.01)
    loss = Band("final_val_loss", reference=3.5, noise=0.0, tolerance=0.002)
    assert loss.holds(3.505) and not loss.holds(3.5 * 1.005) and not loss.holds(3.48), "two-sided: a change is one"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("run: [1\n", "not valid YAML at line"),
        ("- 1\n", "must be a YAML mapping"),
        ("tolerance: 0.25\nratios: []\n", "old one-sided format"),
        ("run: {steps: 40}\n", "lacks checks"),
        ("run: {steps: 40}\nchecks: []\nextra: 1\n", "unknown key(s) extra"),
        (
            "reference_code: HEAD\nrun: {steps: 40}\nchecks: [{method: local, profile: 100mbps}]\n",
            "reference_code must be a full 40-digit git commit",
        ),
        ("run: {steps: 40}\nchecks: {}\n", "checks must be a non-empty list"),
        ("run: {model: tiny}\nchecks: [{method: local}]\n", "run: lacks steps"),
        ("run: {steps: 40}\nchecks: [{method: opendiloco}]\n", "checks[0] lacks profile"),
        ("run: {steps: 40}\nchecks: [{method: local, profile: 100mbps}]\n", "checks[0] (local) has no band"),
        ("run: {steps: 40}\nchecks: [{method: local, profile: 100mbps, speed: 1}]\n", "unknown key(s) speed"),
        (
            "run: {steps: 40}\nchecks: [{method: dilocox, profile: 100mbps, utilisation: {}}]\n",
            "checks[0] gates utilisation, a metric of the gate before it measured only what does not move",
        ),
        # Raises no test reached before (a coverage run, 2026-12-07): a hand-edited baseline's other mistakes.
        ("run: [steps, 40]\nchecks: [{method: local, profile: 100mbps}]\n", "run must be a mapping of run settings"),
        ("run: {steps: 40, seed: x}\nchecks: [{method: local}]\n", "run: seed must be an integer, got 'x'"),
        ("run: {steps: 40, methods: [local]}\nchecks: [{method: local}]\n", "run: methods must map a method name"),
        ("run: {steps: 40, methods: {local: 3}}\nchecks: [{method: local}]\n", "run: methods: local must map option"),
        ("run: {steps: 40}\nchecks: [local]\n", "checks[0] must be a mapping with method, profile and metric bands"),
        (
            "run: {steps: 40}\nchecks: [{method: local, profile: 7,\n"
            "  final_val_loss: {reference: 1, noise: 0, tolerance: 0.1}}]\n",
            "profile must be a profile name or a path",
        ),
    ],
)
def test_malformed_baseline_is_one_clear_sentence_and_exit_2(tmp_path, text, message):
    path = tmp_path / "baseline.yaml"
    path.write_text(text)
    with pytest.raises(BaselineError) as err:
        load_baseline(path)
    assert message in str(err.value)
    out = check("--baseline", path, "--results", tmp_path)
    assert out.exit_code == 2
    assert message in " ".join(out.output.split())


@pytest.mark.parametrize(
    ("band", "message"),
    [
        ({"reference": 1.0, "tolerance": 0.2}, "step_overhead must be a mapping of exactly reference, noise"),
        ({"reference": 0, "noise": 0, "tolerance": 0.2}, "reference must be a positive number"),
        ({"reference": "high", "noise": 0, "tolerance": 0.2}, "reference must be a positive number"),
        ({"reference": 1.0, "noise": -1, "tolerance": 0.2}, "noise must be a number of at least 0"),
        ({"reference": 1.0, "noise": 0, "tolerance": ".nan"}, "tolerance must be a number of at least 0"),
    ],
)
def test_bad_bands_are_refused(tmp_path, band, message):
    with pytest.raises(BaselineError, match=message):
        load_baseline(baseline_file(tmp_path, band))


def test_numbers_written_as_a_person_would_are_numbers(tmp_path):
    path = baseline_file(tmp_path)
    # PyYAML reads 1e9 (no dot) as a string; the baseline must still take it as 1e9.
    path.write_text(path.read_text().replace("reference: 1.07", "reference: 1e9"))
    assert load_baseline(path).checks[0].bands[0].reference == 1e9


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("method", "nosuch", "unknown method 'nosuch'"),
        ("profile", "5mbps", "unknown profile '5mbps'"),
        ("profile", "missing.yaml", "does not exist"),
    ],
)
def test_unknown_names_are_refused(tmp_path, field, value, message):
    path = baseline_file(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["checks"][0][field] = value
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(BaselineError, match=message):
        load_baseline(path)


def test_run_section_is_validated(tmp_path):
    with pytest.raises(BaselineError, match="unknown setting"):
        load_baseline(baseline_file(tmp_path, nosuch=1))
    with pytest.raises(BaselineError, match="local_steps is not a setting of allreduce"):
        load_baseline(baseline_file(tmp_path, methods={"allreduce": {"local_steps": 3}}))
    with pytest.raises(BaselineError, match="repeats must be a positive integer"):
        load_baseline(baseline_file(tmp_path, repeats=0))


def test_a_method_checked_twice_is_refused(tmp_path):
    path = baseline_file(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["checks"].append(data["checks"][0])
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(BaselineError, match="opendiloco on 100mbps twice"):
        load_baseline(path)


def test_profile_paths_are_relative_to_the_baseline_file(tmp_path):
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "paper-107b.yaml").write_text("inter_cluster: {rate: 1mbit}\n")
    path = baseline_file(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["checks"][0]["profile"] = "profiles/paper-107b.yaml"
    path.write_text(yaml.safe_dump(data))
    (spec,) = load_baseline(path).checks
    assert spec.profile == str(tmp_path / "profiles" / "paper-107b.yaml")
    assert spec.profile_name == "paper-107b"


def test_needed_runs_are_one_sweep_per_profile_of_the_checks_methods(tmp_path):
    path = baseline_file(tmp_path, seed=3, repeats=2, methods={"opendiloco": {"local_steps": 5}})
    data = yaml.safe_load(path.read_text())
    loss = {"reference": 3.5, "noise": 0.0, "tolerance": 0.002}
    data["checks"].append({"method": "cocktail", "profile": "1gbps", "final_val_loss": loss})
    path.write_text(yaml.safe_dump(data))
    specs = needed_runs(load_baseline(path))
    assert [(s.profiles, s.methods) for s in specs] == [(("100mbps",), ("opendiloco",)), (("1gbps",), ("cocktail",))]
    combinations = {c.name: c for c in specs[0].combinations()}
    assert sorted(combinations) == [f"opendiloco-100mbps-s3-r{i}" for i in range(2)]
    assert specs[0].config(combinations["opendiloco-100mbps-s3-r1"]).method_options == {"local_steps": 5}
    assert [c.name for c in needed_runs(load_baseline(path), repeats=1)[1].combinations()] == ["cocktail-1gbps-s3"]
    assert [s.methods for s in needed_runs(load_baseline(path), methods=["cocktail"])] == [("cocktail",)]


def test_the_committed_baseline_is_valid_and_gates_every_method():
    baseline = load_baseline(pathlib.Path(__file__).parents[4] / "results/reference/baseline.yaml")
    gated = {(c.method, b.metric) for c in baseline.checks for b in c.bands}
    for method in ("allreduce", "dilocox", "opendiloco", "cocktail", "sparseloco", "demo"):
        assert {(method, m) for m in METRICS} - set(UNGATED) <= gated
    assert not set(UNGATED) & gated
    assert baseline.settings["steps"] == 40 and baseline.repeats == 3
    assert baseline.reference_code is not None, "step_overhead is held to the reference code run where CI checks"


@pytest.mark.parametrize("name", ["summary.json", "config.json", "environment.json"])
def test_stored_runs_name_a_damaged_file(tmp_path, name):
    run = fake_run(tmp_path / "results", "ar", "allreduce", 1.1, 3420, 3.62)
    (run / "environment.json").write_text(json.dumps({"cpu_count": 2}))
    assert load_stored_runs([tmp_path / "results"])[0].environment == {"cpu_count": 2}
    why = damage(run / name, "truncated")
    with pytest.raises(UnreadableResults) as err:
        load_stored_runs([tmp_path / "results"])
    assert err.value.path == run / name and err.value.why == why + " (its JSON ends mid-value)"
