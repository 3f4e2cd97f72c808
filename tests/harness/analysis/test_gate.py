"""`harness baseline` and `harness check`: bands, their derivation, realistic regressions, on made-up run folders.

The repeats below are shaped like the CI gate's (tiny model, 100 Mbit/s, 40 steps, 3 repeats): a slow-compute
machine where allreduce makes ~4,200 tokens/s and local ~10,500.
"""

from __future__ import annotations

import json
import shlex

import pytest
import yaml
from click.testing import CliRunner

from harness.analysis.gate import (
    METRICS,
    TOLERANCE_K,
    Band,
    BaselineError,
    derive_baseline,
    evaluate,
    load_baseline,
    load_stored_runs,
    needed_runs,
    sweep_command,
    write_baseline,
)
from harness.cli import main
from harness.run.config import RunConfig
from harness.run.summary import summarize
from tests.harness.fakeruns import write_run

STEPS = 40
OPTIONS = {"dilocox": {"local_steps": 10}, "opendiloco": {"local_steps": 10}}
# method -> (tokens/s, wire bytes per applied token, final validation loss) of the reference machine.
REFERENCE = {
    "allreduce": (4180.0, 3586.0, 3.62),
    "local": (10500.0, 0.5, 3.75),
    "dilocox": (10100.0, 45.3, 3.70),
    "opendiloco": (9900.0, 700.0, 3.58),
    "cocktail": (4800.0, 950.0, 3.80),
}
# Run-to-run noise of the three repeats: tokens/s moves by a few percent, bytes barely, the loss not at all.
TOKEN_JITTER = (1.0, 0.96, 1.03)
WIRE_JITTER = (1.0, 1.002, 0.999)


def fake_run(root, name, method, tokens_per_s, wire, loss, steps=STEPS, seed=0, options=None):
    """write_run, plus what it leaves out: applied tokens (every trained token here), so the summary has
    wire_bytes_per_token per applied token as a real run's does. summary.json is rewritten by summarize itself."""
    options = OPTIONS.get(method, {}) if options is None else options
    run_dir = write_run(
        root, name, method, profile="100mbps", seed=seed, tokens_per_s=tokens_per_s, wire_bytes_per_token=wire,
        val_losses=(5.5, 4.5, loss), steps=steps, options=options,
    )  # fmt: skip
    if json.loads((run_dir / "summary.json").read_text()).get("applied_tokens") is None:
        for rank_file in (run_dir / "ranks").glob("rank*.json"):
            result = json.loads(rank_file.read_text())
            result.update(applied_tokens=result["tokens"], window_applied_tokens=result["window_tokens"])
            rank_file.write_text(json.dumps(result))
        config = RunConfig.load(run_dir / "config.json")
        (run_dir / "summary.json").write_text(json.dumps(summarize(config, run_dir, None, {}), indent=2))
    return run_dir


def write_repeats(root, changes=None, steps=STEPS, seed=0, token_jitter=TOKEN_JITTER):
    """Three repeats of every method; `changes` maps a method to (tokens/s, wire, loss) factors: a regression."""
    for method, (tokens, wire, loss) in REFERENCE.items():
        by_tokens, by_wire, by_loss = (changes or {}).get(method, (1, 1, 1))
        for i, (tj, wj) in enumerate(zip(token_jitter, WIRE_JITTER, strict=True)):
            run = (tokens * by_tokens * tj, wire * by_wire * wj, loss * by_loss)
            fake_run(root, f"{method}-r{i}", method, *run, steps, seed)
    return root


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The reference repeats and the baseline `harness baseline` writes from them (made once: ~15 fake runs)."""
    folder = tmp_path_factory.mktemp("reference")
    results = write_repeats(folder / "repeats")
    out = folder / "baseline.yaml"
    made = CliRunner().invoke(main, ["baseline", str(results), "--out", str(out)])
    assert made.exit_code == 0, made.output
    return results, out


def check(*args):
    return CliRunner().invoke(main, ["check", *map(str, args)])


def verdicts(output):
    """(method, metric) -> verdict, from the table `harness check` prints."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in output.splitlines() if line.startswith("| ")]
    return {(r[1], r[3]): r[0] for r in rows[1:]}


# --- writing a baseline ------------------------------------------------------------------------------------------


def test_baseline_has_two_sided_bands_from_the_medians_and_the_spread(reference):
    _, path = reference
    baseline = load_baseline(path)
    bands = {(c.method, b.metric): b for c in baseline.checks for b in c.bands}
    assert set(bands) == {
        ("allreduce", "wire_bytes_per_token"), ("allreduce", "final_val_loss"), ("local", "final_val_loss"),
        *((m, metric) for m in ("dilocox", "opendiloco", "cocktail") for metric in METRICS),
    }  # fmt: skip
    # utilisation: the quotient of the medians; its spread both sides' (max - min) / median, root-sum-squared.
    util = bands[("dilocox", "utilisation")]
    assert util.reference == pytest.approx(10100 / 10500, rel=1e-3)
    side = (1.03 - 0.96) / 1.0
    assert util.spread == pytest.approx((2 * side**2) ** 0.5, rel=1e-2)
    assert util.tolerance == pytest.approx(max(METRICS["utilisation"].floor, TOLERANCE_K * util.spread), abs=1e-3)
    assert bands[("cocktail", "ratio")].reference == pytest.approx(4800 / 4180, rel=1e-3)
    assert bands[("cocktail", "ratio")].tolerance == METRICS["ratio"].floor
    wire = bands[("opendiloco", "wire_bytes_per_token")]
    assert wire.reference == pytest.approx(700, rel=1e-3) and wire.tolerance == METRICS["wire_bytes_per_token"].floor
    loss = bands[("opendiloco", "final_val_loss")]
    assert (loss.reference, loss.spread, loss.tolerance) == (3.58, 0.0, METRICS["final_val_loss"].floor)
    assert loss.lower is None and loss.upper == pytest.approx(3.58 * 1.02)
    assert baseline.settings["steps"] == STEPS and baseline.settings["eval_every"] == STEPS // 2
    assert (baseline.seed, baseline.repeats) == (0, 3)
    assert baseline.method_options == OPTIONS


def test_band_is_a_factor_either_way():
    band = Band("utilisation", reference=0.8, spread=0.05, tolerance=0.25)
    assert (band.lower, band.upper) == (pytest.approx(0.64), pytest.approx(1.0))
    assert band.holds(0.64) and band.holds(1.0) and not band.holds(0.4) and not band.holds(1.01)


def regeneration_command(text):
    """The command in a baseline file's header: the comment lines after "with:" up to the empty one, joined."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("with:")) + 2
    end = lines.index("#", start)
    return " ".join(line.lstrip("#").strip().removesuffix("\\").strip() for line in lines[start:end])


def test_baseline_file_says_how_to_regenerate_it_and_how_the_bands_were_derived(reference):
    results, path = reference
    text = path.read_text()
    assert regeneration_command(text).endswith(f" && harness baseline {results} --out {path}")
    assert "tolerance = max(floor, 3 x spread)" in text
    assert "# dilocox on 100mbps: 3 runs, median 10,100 tokens/s" in text
    # Every band line shows the band it allows.
    assert "utilisation:" in text and "# 0." in text and "at most 3.692" in text


def test_header_sweep_command_makes_the_runs_check_would_make(reference):
    """The regeneration command parses as `harness sweep` and makes the very runs `harness check` makes."""
    from harness.analysis.sweep import per_method_settings

    results, path = reference
    baseline = load_baseline(path)
    command, _ = regeneration_command(path.read_text()).split(" && ")
    assert [command] == sweep_command(baseline, str(results))
    words = shlex.split(command)
    assert words[:2] == ["harness", "sweep"] and words[-2:] == ["--out", str(results)]
    with main.commands["sweep"].make_context("sweep", words[2:]) as ctx:
        params = ctx.params
    settings = {k: v for k, v in params.items() if v is not None and k in baseline.settings}
    (spec,) = needed_runs(baseline)
    assert settings == dict(spec.settings)
    assert per_method_settings(params["method_set"]) == spec.per_method
    assert (params["methods"].split(","), params["repeats"], params["force"]) == (list(spec.methods), 3, True)
    assert params["seeds"] == "0" and params["profiles"] == "100mbps"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda root: [fake_run(root, m, m, 4000, 3586, 3.6) for m in ("allreduce", "local")],
            "holds 1 allreduce run on 100mbps; a baseline's tolerances come from the spread of repeats",
        ),
        (
            lambda root: [fake_run(root, f"ar{i}", "allreduce", 4000, 3586, 3.6) for i in range(2)],
            "has no local runs on 100mbps",
        ),
        (
            lambda root: [fake_run(root, f"ar{i}", "allreduce", 4000, 3586, 3.6, steps=40 + 20 * i) for i in range(2)],
            "mixes runs made with different settings",
        ),
        (
            lambda root: [
                fake_run(root, f"dl{i}", "dilocox", 4000, 45, 3.6, options={"local_steps": 10 * (i + 1)})
                for i in range(2)
            ],
            "holds dilocox runs with different options",
        ),
    ],
)
def test_baseline_refuses_results_that_cannot_make_one(tmp_path, build, message):
    build(tmp_path / "results")
    out = CliRunner().invoke(main, ["baseline", str(tmp_path / "results"), "--out", str(tmp_path / "b.yaml")])
    assert out.exit_code == 2, out.output
    assert message in " ".join(out.output.split())
    assert not (tmp_path / "b.yaml").exists()


def test_baseline_refuses_repeats_too_noisy_to_catch_a_halving(tmp_path):
    write_repeats(tmp_path / "results", token_jitter=(1.0, 0.7, 1.3))
    with pytest.raises(BaselineError, match="utilisation varied by 85% over the repeats.*quieter machine"):
        derive_baseline(tmp_path / "results")


def test_baseline_refuses_a_failed_run(tmp_path):
    write_repeats(tmp_path / "results")
    write_run(tmp_path / "results", "broken", "dilocox", profile="100mbps", steps=STEPS, failure="rank 1 died")
    with pytest.raises(BaselineError, match="1 run\\(s\\) in .* failed .*rank 1 died.*run the sweep again"):
        derive_baseline(tmp_path / "results")


# --- checking: realistic regressions -----------------------------------------------------------------------------


def test_round_trip_the_reference_runs_pass_their_own_baseline(reference):
    results, path = reference
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 0, out.output
    assert "15 of 15 bands hold" in out.output
    found = verdicts(out.output)
    assert len(found) == 15 and set(found.values()) == {"holds"}


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
    assert found[("opendiloco", "ratio")] == "BELOW"
    assert found[("dilocox", "utilisation")] == "holds"
    assert "13 of 15 bands hold" in out.output


def test_a_method_that_stops_sending_fails(reference, tmp_path):
    """cocktail that no longer communicates: ~0 bytes per token, and it trains as fast as local."""
    _, path = reference
    results = write_repeats(tmp_path / "results", {"cocktail": (10500 / 4800, 0.0001, 1)})
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 1, out.output
    found = verdicts(out.output)
    assert found[("cocktail", "wire_bytes_per_token")] == "BELOW"
    assert found[("cocktail", "ratio")] == "ABOVE"
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


# --- the baseline file -------------------------------------------------------------------------------------------


def baseline_file(tmp_path, band=None, **run):
    data = {
        "run": {"model": "tiny", "steps": STEPS, "eval_every": 20, "seed": 0, **run},
        "checks": [
            {
                "method": "opendiloco",
                "profile": "100mbps",
                "utilisation": band or {"reference": 0.94, "spread": 0.1, "tolerance": 0.3},
            },
        ],  # fmt: skip
    }
    path = tmp_path / "baseline.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("run: [1\n", "not valid YAML at line"),
        ("- 1\n", "must be a YAML mapping"),
        ("tolerance: 0.25\nratios: []\n", "old one-sided format"),
        ("run: {steps: 40}\n", "lacks checks"),
        ("run: {steps: 40}\nchecks: []\nextra: 1\n", "unknown key(s) extra"),
        ("run: {steps: 40}\nchecks: {}\n", "checks must be a non-empty list"),
        ("run: {model: tiny}\nchecks: [{method: local}]\n", "run: lacks steps"),
        ("run: {steps: 40}\nchecks: [{method: opendiloco}]\n", "checks[0] lacks profile"),
        ("run: {steps: 40}\nchecks: [{method: local, profile: 100mbps}]\n", "checks[0] (local) has no band"),
        ("run: {steps: 40}\nchecks: [{method: local, profile: 100mbps, speed: 1}]\n", "unknown key(s) speed"),
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
        ({"reference": 1.0, "tolerance": 0.2}, "utilisation must be a mapping of exactly reference, spread"),
        ({"reference": 0, "spread": 0, "tolerance": 0.2}, "reference must be a positive number"),
        ({"reference": "high", "spread": 0, "tolerance": 0.2}, "reference must be a positive number"),
        ({"reference": 1.0, "spread": -1, "tolerance": 0.2}, "spread must be a number of at least 0"),
        ({"reference": 1.0, "spread": 0, "tolerance": ".nan"}, "tolerance must be a number of at least 0"),
    ],
)
def test_bad_bands_are_refused(tmp_path, band, message):
    with pytest.raises(BaselineError, match=message):
        load_baseline(baseline_file(tmp_path, band))


def test_numbers_written_as_a_person_would_are_numbers(tmp_path):
    path = baseline_file(tmp_path)
    # PyYAML reads 1e9 (no dot) as a string; the baseline must still take it as 1e9.
    path.write_text(path.read_text().replace("reference: 0.94", "reference: 1e9"))
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
    with pytest.raises(BaselineError, match="does not apply to method 'allreduce'"):
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


def test_needed_runs_add_the_methods_the_metrics_divide_by(tmp_path):
    path = baseline_file(tmp_path, seed=3, repeats=2, methods={"opendiloco": {"local_steps": 5}})
    data = yaml.safe_load(path.read_text())
    loss = {"reference": 3.5, "spread": 0.0, "tolerance": 0.02}
    data["checks"].append({"method": "cocktail", "profile": "1gbps", "final_val_loss": loss})
    path.write_text(yaml.safe_dump(data))
    specs = needed_runs(load_baseline(path))
    assert [(s.profiles, s.methods) for s in specs] == [
        (("100mbps",), ("local", "opendiloco")),
        (("1gbps",), ("cocktail",)),
    ]
    combinations = {c.name: c for c in specs[0].combinations()}
    assert sorted(combinations) == [f"{m}-100mbps-s3-r{i}" for m in ("local", "opendiloco") for i in range(2)]
    assert specs[0].config(combinations["opendiloco-100mbps-s3-r1"]).method_options == {"local_steps": 5}
    assert [c.name for c in needed_runs(load_baseline(path), repeats=1)[1].combinations()] == ["cocktail-1gbps-s3"]


def test_the_committed_baseline_is_valid_and_gates_every_method():
    baseline = load_baseline(__import__("pathlib").Path(__file__).parents[3] / "results/reference/baseline.yaml")
    gated = {(c.method, b.metric) for c in baseline.checks for b in c.bands}
    for method in ("dilocox", "opendiloco", "cocktail"):
        assert {(method, m) for m in METRICS} <= gated
    assert baseline.settings["steps"] == 40 and baseline.repeats == 3


def test_write_baseline_replaces_the_file_only_when_it_reads_back(reference, tmp_path):
    results, _ = reference
    out = tmp_path / "deep" / "baseline.yaml"
    derived = write_baseline(results, out)
    assert load_baseline(out) == derived.baseline
    assert [p.name for p in out.parent.iterdir()] == ["baseline.yaml"]
