"""`harness baseline` (harness/analysis/gate/baseline.py): bands derived from repeats, the file's header, and the
results it refuses to derive from."""

from __future__ import annotations

import os
import shlex
import statistics
import subprocess
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from harness.analysis.gate.bands import METRICS, BaselineError, load_baseline, needed_runs, sweep_command
from harness.analysis.gate.baseline import CHECK_REPEATS, TOLERANCE_K, UNGATED, derive_baseline, write_baseline
from harness.cli import main
from tests.harness.analysis.gate.repeats import (
    OPTIONS,
    OVERHEAD_JITTER,
    REFERENCE,
    REPEATS,
    STEPS,
    fake_run,
    write_repeats,
)
from tests.harness.fakeruns import write_run


def test_baseline_has_two_sided_bands_from_the_medians_and_the_noise(reference):
    _, path = reference
    baseline = load_baseline(path)
    bands = {(c.method, b.metric): b for c in baseline.checks for b in c.bands}
    assert set(bands) == {
        ("local", "step_overhead"), ("local", "final_val_loss"),
        *((m, metric) for m in ("allreduce", "dilocox", "opendiloco", "cocktail") for metric in METRICS),
    } - set(UNGATED)  # fmt: skip
    assert ("cocktail", "step_overhead") in UNGATED and "Not gated: cocktail step_overhead" in path.read_text()
    overhead = bands[("opendiloco", "step_overhead")]
    values = [REFERENCE["opendiloco"][0] * j for j in OVERHEAD_JITTER]
    assert overhead.reference == pytest.approx(statistics.median(values), rel=1e-6)
    assert overhead.noise == pytest.approx(statistics.stdev(values) / statistics.median(values), rel=1e-2)
    assert overhead.tolerance == pytest.approx(max(METRICS["step_overhead"].floor, TOLERANCE_K * overhead.noise))
    payload = bands[("opendiloco", "payload_bytes_per_token")]
    assert payload.reference == pytest.approx(171, rel=1e-4) and payload.noise == 0.0
    assert payload.tolerance == METRICS["payload_bytes_per_token"].floor
    loss = bands[("opendiloco", "final_val_loss")]
    assert (loss.reference, loss.noise, loss.tolerance) == (3.214, 0.0, METRICS["final_val_loss"].floor)
    assert loss.lower == pytest.approx(3.214 / 1.002) and loss.upper == pytest.approx(3.214 * 1.002)
    assert baseline.settings["steps"] == STEPS and baseline.settings["eval_every"] == STEPS // 2
    assert (baseline.seed, baseline.repeats) == (0, CHECK_REPEATS), "a check makes 3; the bands came from 5"
    assert baseline.method_options == OPTIONS
    assert {c.method: c.profile_name for c in baseline.checks}["dilocox"] == "10mbps"


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
    assert "tolerance = max(floor, 3.2 x noise)" in text
    assert "# dilocox on 10mbps: 5 runs, median" in text
    # Every band line shows the band it allows.
    assert "step_overhead:" in text and "# 3.2076 to 3.2204" in text


def test_header_sweep_command_makes_the_runs_check_would_make(reference):
    """The regeneration command parses as `harness sweep` and makes the very runs `harness check` makes."""
    from harness.analysis.plan import sweep_settings
    from harness.run.settings import parse_assignments

    results, path = reference
    baseline = load_baseline(path)
    *commands, _ = regeneration_command(path.read_text()).split(" && ")
    assert commands == sweep_command(baseline, str(results), repeats=REPEATS)
    specs = needed_runs(baseline)
    assert len(commands) == len(specs) == 2
    for command, spec in zip(commands, specs, strict=True):
        words = shlex.split(command)
        assert words[:2] == ["harness", "sweep"] and words[-2:] == ["--out", str(results)]
        with main.get_command(click.Context(main), "sweep").make_context("sweep", words[2:]) as ctx:
            params = ctx.params
        fixed, grid, per_method = sweep_settings(parse_assignments(params["assignments"]))
        settings = {k: v for k, v in params.items() if v is not None and k in baseline.settings}
        assert {**settings, **fixed} == dict(spec.settings) and grid == ()
        assert per_method == spec.per_method
        assert (params["methods"].split(","), params["repeats"], params["force"]) == (list(spec.methods), 5, True)
        assert params["seeds"] == "0" and (params["profiles"],) == spec.profiles


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda root: [fake_run(root, f"ar{i}", "allreduce", 1.1, 3420, 3.6) for i in range(4)],
            "holds 4 allreduce run(s) on 100mbps; a baseline's tolerances come from the noise of at least 5 repeats",
        ),
        (
            lambda root: [fake_run(root, f"ar{i}", "allreduce", 1.1, 3420, 3.6, steps=40 + 20 * i) for i in range(2)],
            "mixes runs made with different settings",
        ),
        (
            lambda root: [
                fake_run(root, f"dl{i}", "dilocox", 1.2, 27, 3.6, options={"local_steps": 10 * (i + 1)})
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


def test_baseline_refuses_repeats_too_noisy_to_catch_a_step_15pct_slower(tmp_path):
    write_repeats(tmp_path / "results", jitter=(1.0, 0.9, 1.1, 0.95, 1.05))
    with pytest.raises(BaselineError, match="step_overhead varied by 7.9% .* could not catch a step 15% slower"):
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


def test_diff_says_what_changed_between_two_baselines(reference, tmp_path):
    results, path = reference
    newer = tmp_path / "newer"
    write_repeats(newer, {"dilocox": (1.1, 0.5, 1)})
    new_path = tmp_path / "new.yaml"
    write_baseline(newer, new_path)
    text = new_path.read_text().replace("steps: 40", "steps: 40\n  lr: 0.001", 1)
    new_path.write_text(text.replace("    opendiloco: {local_steps: 10}\n", ""))
    out = CliRunner().invoke(main, ["baseline", "--diff", str(path), str(new_path)])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert "- lr: '(unset)' -> 0.001" in lines and "- methods: " in out.output
    row = next(line for line in lines if "| dilocox" in line and "payload_bytes_per_token" in line)
    assert "-50.00%" in row
    row = next(line for line in lines if "| dilocox" in line and "step_overhead" in line)
    assert "+10.00%" in row
    assert all("+0.00%" in line for line in lines if "| allreduce" in line)


def test_reference_code_is_written_as_a_full_commit_and_a_bad_one_writes_nothing(reference, tmp_path):
    results, _ = reference
    repo = Path(__file__).resolve().parents[4]
    head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    head = head.stdout.strip()
    out = tmp_path / "baseline.yaml"
    made = CliRunner().invoke(main, ["baseline", str(results), "--out", str(out), "--reference-code", "HEAD"])
    assert made.exit_code == 0, made.output
    assert load_baseline(out).reference_code == head and f"reference_code: {head}\n" in out.read_text()
    assert regeneration_command(out.read_text()).endswith(f"--out {out} --reference-code {head}")
    other = tmp_path / "other.yaml"
    bad = CliRunner().invoke(main, ["baseline", str(results), "--out", str(other), "--reference-code", "no-such"])
    assert bad.exit_code == 2 and "'no-such' names no commit of" in bad.output and not other.exists()
    changed = CliRunner().invoke(main, ["baseline", "--diff", str(reference[1]), str(out)])
    assert f"- reference_code: None -> '{head}'" in changed.output


def test_diff_reads_a_baseline_of_the_former_format(reference, tmp_path):
    """The comparison a regenerated gate needs: the old file's metrics (utilisation, spread) beside the new."""
    _, path = reference
    old = tmp_path / "old.yaml"
    old.write_text(
        "run: {model: tiny, steps: 40}\nchecks:\n- method: dilocox\n  profile: 100mbps\n"
        "  utilisation: {reference: 0.87, spread: 0.067, tolerance: 0.35}\n"
    )
    out = CliRunner().invoke(main, ["baseline", "--diff", str(old), str(path)])
    assert out.exit_code == 0, out.output
    assert "- check dropped: dilocox on 100mbps" in out.output and "- check added: dilocox on 10mbps" in out.output
    assert "utilisation (dropped)" in out.output and "step_overhead (new)" in out.output
    bad = CliRunner().invoke(main, ["baseline", "--diff", str(old), str(path), "--out", str(tmp_path / "x.yaml")])
    assert bad.exit_code == 2 and "--diff OLD NEW compares two files" in bad.output


def test_a_baseline_of_a_method_from_a_file_names_the_file_so_it_checks_without_an_edit(tmp_path, monkeypatch):
    from trainers import registry

    # The example registers in this process: keep it out of the other tests' method list.
    monkeypatch.setattr(registry, "METHODS", dict(registry.METHODS))
    plugin = Path(__file__).resolve().parents[4] / "examples" / "local_int8.py"
    results = tmp_path / "results"
    for repeat in range(REPEATS):
        write_run(results, f"r{repeat}", f"{plugin}:LocalInt8", profile="100mbps", steps=STEPS, sync_every=10,
                  tokens_per_s=1000.0 * (1 + 0.01 * repeat))  # fmt: skip
    out = tmp_path / "gate" / "baseline.yaml"
    write_baseline(results, out)
    expected = f"{os.path.relpath(plugin, out.parent)}:LocalInt8"
    assert f"  - method: {expected}\n" in out.read_text()
    (check,) = load_baseline(out).checks
    assert check.method == "localint8"
