"""`harness check`: the baseline file, the ratio arithmetic and the exit codes, on made-up run folders."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from harness.cli import main
from harness.regress import BaselineError, evaluate, load_baseline, needed_runs
from harness.report import load_runs
from tests.harness.fakeruns import write_run


@pytest.fixture
def results(tmp_path):
    """Three repeats each: allreduce at ~1000 tokens/s, opendiloco at ~4000 (medians 1000 and 4000)."""
    root = tmp_path / "results"
    for i, (ar, dl) in enumerate([(1000, 4000), (900, 4100), (1300, 3000)]):
        write_run(root, f"ar-r{i}", "allreduce", profile="100mbps", tokens_per_s=ar)
        write_run(root, f"dl-r{i}", "opendiloco", profile="100mbps", tokens_per_s=dl, options={"local_steps": 10})
    return root


def baseline_file(tmp_path, min_ratio=3.0, **extra):
    data = {
        "tolerance": 0.25,
        "ratios": [
            {
                "method": "opendiloco",
                "baseline": "allreduce",
                "profile": "100mbps",
                "metric": "tokens_per_s",
                "min_ratio": min_ratio,
            },
        ],  # fmt: skip
        **extra,
    }
    path = tmp_path / "baseline.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def check(*args):
    return CliRunner().invoke(main, ["check", *map(str, args)])


def test_ratio_is_the_ratio_of_medians(results, tmp_path):
    (result,) = evaluate(load_baseline(baseline_file(tmp_path)), load_runs([results]).runs)
    assert (result.method_value, result.baseline_value) == (4000, 1000)
    assert result.measured == pytest.approx(4.0)
    assert result.threshold == pytest.approx(3.0 * 0.75)
    assert (result.method_runs, result.baseline_runs, result.ok) == (3, 3, True)


def test_check_exits_0_when_every_ratio_holds(results, tmp_path):
    # 4.0 measured against 5.0 * (1 - 0.25) = 3.75: holds only thanks to the tolerance.
    out = check("--baseline", baseline_file(tmp_path, min_ratio=5.0), "--results", results)
    assert out.exit_code == 0, out.output
    assert "holds" in out.output and "1 of 1 ratios hold" in out.output


def test_check_exits_1_when_a_ratio_cannot_hold(results, tmp_path):
    path = baseline_file(tmp_path)
    # Written as a person would: PyYAML reads 1e9 (no dot) as a string, and the check must still take it as 1e9.
    path.write_text(path.read_text().replace("min_ratio: 3.0", "min_ratio: 1e9"))
    assert load_baseline(path).ratios[0].min_ratio == 1e9
    out = check("--baseline", path, "--results", results)
    assert out.exit_code == 1, out.output
    assert "FALLS SHORT" in out.output and "0 of 1 ratios hold" in out.output


def test_missing_runs_fail_the_check(tmp_path):
    write_run(tmp_path / "results", "ar", "allreduce", profile="100mbps")
    out = check("--baseline", baseline_file(tmp_path), "--results", tmp_path / "results")
    assert out.exit_code == 1 and "no runs" in out.output


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tolerance: [0.25\n", "not valid YAML at line"),
        ("- 1\n", "must be a YAML mapping"),
        ("tolerance: 0.25\n", "lacks ratios"),
        ("tolerance: 0.25\nratios: []\nextra: 1\n", "unknown key(s) extra"),
        ("tolerance: 2\nratios: []\n", "tolerance must be a number in [0, 1)"),
        ("tolerance: 0.1\nratios: {}\n", "ratios must be a non-empty list"),
        ("tolerance: 0.1\nratios: [{method: opendiloco}]\n", "ratios[0] lacks baseline, profile, metric, min_ratio"),
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
    ("field", "value", "message"),
    [
        ("method", "nosuch", "unknown method 'nosuch'"),
        ("baseline", "nosuch", "unknown baseline 'nosuch'"),
        ("metric", "loss", "unknown metric 'loss'"),
        ("profile", "5mbps", "unknown profile '5mbps'"),
        ("profile", "missing.yaml", "does not exist"),
        ("min_ratio", "five", "min_ratio must be a positive number"),
        ("min_ratio", -1, "min_ratio must be a positive number"),
    ],
)
def test_unknown_names_and_wrong_types_are_refused(tmp_path, field, value, message):
    path = baseline_file(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["ratios"][0][field] = value
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(BaselineError, match=message):
        load_baseline(path)


def test_run_section_is_validated(tmp_path):
    with pytest.raises(BaselineError, match="unknown setting"):
        load_baseline(baseline_file(tmp_path, run={"nosuch": 1}))
    with pytest.raises(BaselineError, match="does not apply to method 'allreduce'"):
        load_baseline(baseline_file(tmp_path, run={"methods": {"allreduce": {"local_steps": 3}}}))


def test_profile_paths_are_relative_to_the_baseline_file(tmp_path):
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "paper-107b.yaml").write_text("inter_cluster: {rate: 1mbit}\n")
    path = baseline_file(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["ratios"][0]["profile"] = "profiles/paper-107b.yaml"
    path.write_text(yaml.safe_dump(data))
    (spec,) = load_baseline(path).ratios
    assert spec.profile == str(tmp_path / "profiles" / "paper-107b.yaml")
    assert spec.profile_name == "paper-107b"


def test_run_options_pick_the_configuration_and_ambiguity_is_refused(results, tmp_path):
    write_run(results, "dl-h50", "opendiloco", profile="100mbps", tokens_per_s=9000, options={"local_steps": 50})
    runs = load_runs([results]).runs
    with pytest.raises(BaselineError, match="2 configurations of opendiloco on 100mbps"):
        evaluate(load_baseline(baseline_file(tmp_path)), runs)
    pinned = load_baseline(baseline_file(tmp_path, run={"methods": {"opendiloco": {"local_steps": 50}}}))
    (result,) = evaluate(pinned, runs)
    assert result.measured == pytest.approx(9.0) and result.method_runs == 1


def test_needed_runs_cover_each_profile_with_its_methods(tmp_path):
    run = {"model": "tiny", "steps": 20, "seed": 3, "methods": {"opendiloco": {"local_steps": 5}}}
    path = baseline_file(tmp_path, run=run)
    data = yaml.safe_load(path.read_text())
    data["ratios"].append({**data["ratios"][0], "method": "local", "profile": "1gbps"})
    path.write_text(yaml.safe_dump(data))
    specs = needed_runs(load_baseline(path), repeats=3)
    assert [(s.profiles, s.methods) for s in specs] == [
        (("100mbps",), ("allreduce", "opendiloco")),
        (("1gbps",), ("allreduce", "local")),
    ]
    names = [c.name for c in specs[0].combinations()]
    assert names == [f"{m}-100mbps-s3-r{i}" for m in ("allreduce", "opendiloco") for i in range(3)]
    assert specs[0].config(specs[0].combinations()[3]).method_options == {"local_steps": 5}
