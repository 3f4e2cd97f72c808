"""The figures: written as PNG and SVG per comparable group, titled, and built from the right numbers."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.plots import loss_figure, plot_all, step_breakdown
from harness.report import eval_curve, load_runs
from tests.harness.fakeruns import write_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "sweep"
    write_run(root, "ar", "allreduce", tokens_per_s=500, blocked_share=0.8, val_losses=(5.5, 4.5, 4.0))
    write_run(root, "dl", "opendiloco", tokens_per_s=5000, blocked_share=0.1, overlapped_s=0.05, finish_blocked_s=1.6,
              options={"local_steps": 10}, val_losses=(5.5, 4.6, 4.2))  # fmt: skip
    write_run(root, "local", "local", tokens_per_s=6000, val_losses=(5.5, 4.8, 4.6))
    write_run(root, "ar-slow", "allreduce", profile="100mbps", tokens_per_s=100)
    return root


def test_every_figure_in_both_formats_per_group(results, tmp_path):
    written = plot_all(load_runs([results]), tmp_path / "figures")
    names = sorted(p.name for p in written)
    expected = [f"{kind}-{group}.{fmt}" for kind in ("breakdown", "loss", "throughput")
                for group in ("100mbps-tiny", "1gbps-tiny") for fmt in ("png", "svg")]  # fmt: skip
    assert names == sorted(expected)
    for path in written:
        assert path.stat().st_size > 5000
    assert (tmp_path / "figures" / "loss-1gbps-tiny.png").read_bytes()[:8] == PNG_MAGIC
    svg = (tmp_path / "figures" / "throughput-1gbps-tiny.svg").read_text()
    # Titles carry the profile and model; bars carry their ratio to allreduce (5000 / 500).
    assert "profile 1gbps" in svg and "model tiny" in svg and "10x" in svg
    assert "tokens/s, log scale" in svg


def test_breakdown_splits_each_step_into_compute_blocked_and_overlapped(results):
    tables = load_runs([results])
    group = tables.runs[tables.runs["profile"] == "1gbps"]
    parts = step_breakdown(group, tables.events)
    step_s = 2048 / 500
    assert parts.loc["allreduce", "compute"] == pytest.approx(0.2 * step_s)
    assert parts.loc["allreduce", "blocked"] == pytest.approx(0.8 * step_s)
    assert parts.loc["opendiloco local_steps=10", "overlapped"] == pytest.approx(0.05)
    # The finish event's wait belongs to the last step: 1.6 s over the 15 steps after warm-up, not compute.
    dl_step_s = 2048 / 5000
    assert parts.loc["opendiloco local_steps=10", "blocked"] == pytest.approx(0.1 * dl_step_s + 1.6 / 15)
    assert parts.loc["opendiloco local_steps=10", "compute"] == pytest.approx(0.9 * dl_step_s)
    assert parts.loc["local", "blocked"] == 0.0


def test_loss_band_only_where_there_are_two_runs_or_more(results):
    write_run(results, "ar-s1", "allreduce", seed=1, tokens_per_s=520, val_losses=(5.5, 4.3, 3.9))
    tables = load_runs([results])
    group = tables.runs[tables.runs["profile"] == "1gbps"]
    colors = {"allreduce": "#000000", "opendiloco local_steps=10": "#111111", "local": "#222222"}
    fig = loss_figure(group, eval_curve(tables.events), colors)
    by_tokens = fig.axes[0]
    labels = [t.get_text() for t in by_tokens.get_legend().get_texts()]
    assert labels == [
        "allreduce (n=2, band ± 1 std)",
        "opendiloco local_steps=10 (n=1, no band)",
        "local (n=1, no band), unsynchronized",
    ]
    # One band: allreduce's, the only method with two runs.
    assert len(by_tokens.collections) == 1
    assert "band: ± 1 std where n ≥ 2" in fig.get_suptitle()


def test_cli_writes_figures_next_to_the_results_by_default(results):
    out = CliRunner().invoke(main, ["plot", str(results)])
    assert out.exit_code == 0, out.output
    assert (results / "figures" / "breakdown-1gbps-tiny.svg").is_file()
    # The figures folder holds no run, so a later report or plot over the same folder is unchanged.
    assert len(load_runs([results]).runs) == 4
