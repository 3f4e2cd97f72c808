"""`harness baseline` (harness/analysis/baseline.py): bands derived from repeats, the file's header, and the results
it refuses to derive from."""

from __future__ import annotations

import shlex

import click
import pytest
from click.testing import CliRunner

from harness.analysis.bands import METRICS, BaselineError, load_baseline, needed_runs, sweep_command
from harness.analysis.baseline import TOLERANCE_K, derive_baseline, write_baseline
from harness.cli import main
from tests.harness.analysis.repeats import OPTIONS, STEPS, fake_run, write_repeats
from tests.harness.fakeruns import write_run


def test_baseline_has_two_sided_bands_from_the_medians_and_the_spread(reference):
    _, path = reference
    baseline = load_baseline(path)
    bands = {(c.method, b.metric): b for c in baseline.checks for b in c.bands}
    assert set(bands) == {
        ("allreduce", "wire_bytes_per_token"), ("allreduce", "final_val_loss"), ("local", "final_val_loss"),
        *((m, metric) for m in ("dilocox", "opendiloco", "cocktail") for metric in METRICS if METRICS[metric].derived),
    }  # fmt: skip
    # The ratio to allreduce moves with the machine's compute speed: reported by check only where a band is given.
    assert not METRICS["ratio"].derived and not any(metric == "ratio" for _, metric in bands)
    # utilisation: the quotient of the medians; its spread both sides' (max - min) / median, root-sum-squared.
    util = bands[("dilocox", "utilisation")]
    assert util.reference == pytest.approx(10100 / 10500, rel=1e-3)
    side = (1.03 - 0.96) / 1.0
    assert util.spread == pytest.approx((2 * side**2) ** 0.5, rel=1e-2)
    assert util.tolerance == pytest.approx(max(METRICS["utilisation"].floor, TOLERANCE_K * util.spread), abs=1e-3)
    wire = bands[("opendiloco", "wire_bytes_per_token")]
    assert wire.reference == pytest.approx(700, rel=1e-3) and wire.tolerance == METRICS["wire_bytes_per_token"].floor
    loss = bands[("opendiloco", "final_val_loss")]
    assert (loss.reference, loss.spread, loss.tolerance) == (3.58, 0.0, METRICS["final_val_loss"].floor)
    assert loss.lower is None and loss.upper == pytest.approx(3.58 * 1.02)
    assert baseline.settings["steps"] == STEPS and baseline.settings["eval_every"] == STEPS // 2
    assert (baseline.seed, baseline.repeats) == (0, 3)
    assert baseline.method_options == OPTIONS


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
    with main.get_command(click.Context(main), "sweep").make_context("sweep", words[2:]) as ctx:
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


def test_write_baseline_replaces_the_file_only_when_it_reads_back(reference, tmp_path):
    results, _ = reference
    out = tmp_path / "deep" / "baseline.yaml"
    derived = write_baseline(results, out)
    assert load_baseline(out) == derived.baseline
    assert [p.name for p in out.parent.iterdir()] == ["baseline.yaml"]
