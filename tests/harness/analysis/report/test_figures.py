"""The figures: written as PNG and SVG per comparable group, titled, and built from the right numbers."""

from __future__ import annotations

import json

import matplotlib
import pytest
from click.testing import CliRunner

from harness.analysis.report.aggregates import comparison
from harness.analysis.report.figures import (
    group_loss_figure,
    monitor_figure,
    plot_all,
    rtt_families,
    step_breakdown,
    sync_rounds,
)
from harness.analysis.report.tables import eval_curve, load_runs
from harness.cli import main
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
    # No run logs DiLoCoX's monitor: no monitor figure.
    assert not any(p.name.startswith("monitor-") for p in written)


def test_breakdown_splits_each_step_into_compute_blocked_and_overlapped(results):
    tables = load_runs([results])
    group = tables.runs[tables.runs["profile"] == "1gbps"]
    parts = step_breakdown(group, tables.events)
    step_s = 2048 / 500
    assert parts.loc["allreduce", "compute"] == pytest.approx(0.2 * step_s)
    assert parts.loc["allreduce", "blocked"] == pytest.approx(0.8 * step_s)
    assert parts.loc["opendiloco (local_steps=10)", "overlapped"] == pytest.approx(0.05)
    # The finish event's wait belongs to the last step: 1.6 s over the 15 steps after warm-up, not compute.
    dl_step_s = 2048 / 5000
    assert parts.loc["opendiloco (local_steps=10)", "blocked"] == pytest.approx(0.1 * dl_step_s + 1.6 / 15)
    assert parts.loc["opendiloco (local_steps=10)", "compute"] == pytest.approx(0.9 * dl_step_s)
    assert parts.loc["local", "blocked"] == 0.0


def test_loss_band_only_where_there_are_two_runs_or_more(results):
    write_run(results, "ar-s1", "allreduce", seed=1, tokens_per_s=520, val_losses=(5.5, 4.3, 3.9))
    tables = load_runs([results])
    group = tables.runs[tables.runs["profile"] == "1gbps"]
    colors = {"allreduce": "#000000", "opendiloco (local_steps=10)": "#111111", "local": "#222222"}
    fig = group_loss_figure(group, eval_curve(tables.events), colors)
    by_tokens = fig.axes[0]
    labels = [t.get_text() for t in by_tokens.get_legend().get_texts()]
    assert labels == [
        "allreduce (n=2, band ± 1 std)",
        "opendiloco (local_steps=10) (n=1, no band)",
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


def _cosine(seed: int, rank: int, t: int) -> float:
    return 0.1 * t + 0.2 * seed + 100 * rank  # rank 1's values are absurd: only rank 0's belong in the figure


def _dilocox_sync(seed: int, syncs: int) -> tuple:
    """A DiLoCoX run's sync fields under the delayed overlap: the k-th sync sends round k and applies round k - 1
    (round 1's cosine has no previous average), and finish applies the last round."""

    def applied(rank: int, t: int) -> dict:
        cosine = None if t == 1 else _cosine(seed, rank, t)
        return {"sync_estimated_rank": 8 - t + seed, "sync_cosine": cosine, "sync_step_norm_ratio": 1.6 + 0.1 * t}

    def fields(rank: int, k: int) -> dict:
        sent = {"sync_round": k, "sync_rank_r": 8 - k, "sync_local_steps_h": 5 + k, "sync_compression_error2": 0.3,
                "sync_omega2_paper": 0.99, "sync_omega2_corrected": 1.2 + seed, "sync_staleness": None}  # fmt: skip
        return {**sent, **(applied(rank, k - 1) if k > 1 else {})}

    return fields, applied(0, syncs)


def _write_dilocox(root, name, seed, local_steps=5):
    fields, finish = _dilocox_sync(seed, 20 // local_steps)
    write_run(root, name, "dilocox", seed=seed, tokens_per_s=4000, options={"local_steps": local_steps},
              sync_every=local_steps, sync_fields=fields, finish_fields=finish)  # fmt: skip


def test_monitor_figure_only_where_a_run_logs_dilocox_sync_fields(results, tmp_path):
    _write_dilocox(results, "dx-s0", seed=0)
    written = plot_all(load_runs([results]), tmp_path / "figures")
    names = {p.name for p in written}
    assert {"monitor-1gbps-tiny.png", "monitor-1gbps-tiny.svg"} <= names
    # The other group has allreduce only.
    assert not any(n.startswith("monitor-100mbps") for n in names)
    assert (tmp_path / "figures" / "monitor-1gbps-tiny.png").read_bytes()[:8] == PNG_MAGIC
    svg = (tmp_path / "figures" / "monitor-1gbps-tiny.svg").read_text()
    assert "profile 1gbps" in svg and "DiLoCoX monitor" in svg


def test_sync_rounds_put_each_field_at_its_round_from_rank_0(tmp_path):
    _write_dilocox(tmp_path, "dx-s0", seed=0)
    write_run(tmp_path, "ar", "allreduce")
    tables = load_runs([tmp_path])
    rounds = sync_rounds(tables.runs, tables.events)
    assert set(rounds["variant"]) == {"dilocox (local_steps=5)"}
    assert rounds["round"].tolist() == [1, 2, 3, 4]
    assert rounds["sync_rank_r"].tolist() == [7, 6, 5, 4]
    assert rounds["sync_local_steps_h"].tolist() == [6, 7, 8, 9]
    # Applied one sync late (delayed overlap), the last by finish; each at the round it carried.
    assert rounds["sync_estimated_rank"].tolist() == [7, 6, 5, 4]
    assert rounds["sync_step_norm_ratio"].tolist() == pytest.approx([1.7, 1.8, 1.9, 2.0])
    assert rounds["sync_cosine"].isna().tolist() == [True, False, False, False]
    assert rounds["sync_cosine"].iloc[1:].tolist() == pytest.approx([0.2, 0.3, 0.4])
    empty = sync_rounds(tables.runs[tables.runs["method"] == "allreduce"], tables.events)
    assert empty.empty


def test_monitor_lines_are_the_mean_over_seeds_with_a_band_only_for_two_runs(tmp_path):
    _write_dilocox(tmp_path, "dx-s0", seed=0)
    _write_dilocox(tmp_path, "dx-s1", seed=1)
    _write_dilocox(tmp_path, "dx10-s0", seed=0, local_steps=10)
    write_run(tmp_path, "ar", "allreduce")
    tables = load_runs([tmp_path])
    colors = {"allreduce": "#000000", "dilocox (local_steps=10)": "#0000ff", "dilocox (local_steps=5)": "#ff0000"}
    fig = monitor_figure(tables.runs, sync_rounds(tables.runs, tables.events), colors)
    cosine, ratio, rank, error, steps = fig.axes

    def lines(ax, color):
        return [line for line in ax.get_lines() if matplotlib.colors.to_hex(line.get_color()) == color]

    (two,) = lines(cosine, "#ff0000")
    assert two.get_xdata().tolist() == [2, 3, 4]
    # Seeds 0 and 1: 0.1 t and 0.1 t + 0.2, so the mean is 0.1 t + 0.1.
    assert two.get_ydata().tolist() == pytest.approx([0.3, 0.4, 0.5])
    (one,) = lines(cosine, "#0000ff")
    assert one.get_xdata().tolist() == [2] and one.get_ydata().tolist() == pytest.approx([0.2])
    # A band for the variant of two runs only: ± the sample std of two values 0.2 apart, 0.2 / sqrt(2).
    (band,) = cosine.collections
    edge = band.get_paths()[0].vertices[:, 1]
    assert (edge.min(), edge.max()) == pytest.approx((0.3 - 0.2 / 2**0.5, 0.5 + 0.2 / 2**0.5))
    # r_t dashed and H_t on the right axis, both at the round sent.
    estimated, chosen = lines(rank, "#ff0000")
    assert estimated.get_ydata().tolist() == pytest.approx([7.5, 6.5, 5.5, 4.5])
    assert chosen.get_linestyle() == "--" and chosen.get_ydata().tolist() == pytest.approx([7, 6, 5, 4])
    (local_steps,) = lines(steps, "#ff0000")
    assert local_steps.get_ydata().tolist() == pytest.approx([6, 7, 8, 9])
    measured, paper, corrected = lines(error, "#ff0000")
    assert [line.get_linestyle() for line in (measured, paper, corrected)] == ["-", "--", "-."]
    assert corrected.get_ydata().tolist() == pytest.approx([1.7] * 4)
    assert lines(ratio, "#000000") == []  # allreduce logs no monitor
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["dilocox (local_steps=10) (n=1, no band)", "dilocox (local_steps=5) (n=2, band ± 1 std)"]


def test_rtt_figure_for_runs_that_differ_only_in_round_trip_time(tmp_path):
    root = tmp_path / "sweep"
    for profile, rtt, speed in (("1gbps", None, 900.0), ("wan-1gbps-40ms-rtt", 40.0, 300.0)):
        for seed in (0, 1):
            run = write_run(root, f"ar-{profile}-{seed}", "allreduce", profile=profile, seed=seed, tokens_per_s=speed)
            summary = json.loads((run / "summary.json").read_text())
            summary["link_rtt_target_ms"] = rtt
            (run / "summary.json").write_text(json.dumps(summary))
    write_run(root, "ar-slow", "allreduce", profile="100mbps", tokens_per_s=100)  # another rate: no family
    written = plot_all(load_runs([root]), tmp_path / "figures")
    rtt_files = sorted(p.name for p in written if p.name.startswith("rtt-"))
    assert rtt_files == ["rtt-tiny-1Gbits.png", "rtt-tiny-1Gbits.svg"]
    svg = (tmp_path / "figures" / "rtt-tiny-1Gbits.svg").read_text()
    assert "round-trip time" in svg and "allreduce (n=2-2)" in svg
    tables = load_runs([root])
    ((_, rows, _),) = rtt_families(tables.runs[tables.runs["status"] == "ok"], comparison(tables))
    assert rows["rtt_ms"].tolist() == [0.0, 40.0]
    assert rows["tokens_per_s"].round().tolist() == [900.0, 300.0]


def test_sites_figure_only_for_groups_with_uneven_sites(results, tmp_path):
    root = tmp_path / "straggler"
    for seed in (0, 1):
        write_run(root, f"ar-{seed}", "allreduce", profile="straggler-1gbps-one-site-100mbps", seed=seed,
                  options={"clusters": 4})  # fmt: skip
    written = plot_all(load_runs([root, results]), tmp_path / "figures")
    sites = sorted(p.name for p in written if p.name.startswith("sites-"))
    assert sites == [
        "sites-straggler-1gbps-one-site-100mbps-tiny.png",
        "sites-straggler-1gbps-one-site-100mbps-tiny.svg",
    ]
    svg = (tmp_path / "figures" / sites[1]).read_text()
    assert "100 Mbit/s" in svg and "allreduce (n=2)" in svg
