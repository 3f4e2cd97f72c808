"""The replayed-link figure (harness/analysis/report/trace_figure.py): drawn by `harness plot` for a run that replayed a
trace, from its run folder alone, and for no other run."""

from __future__ import annotations

import json

from click.testing import CliRunner

from harness.analysis.report.tables import load_runs
from harness.cli import main
from harness.run.config import RunConfig
from harness.run.summary import summarize
from tests.harness.fakeruns import write_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def with_link_trace(run_dir, rate_bps: float = 40e6) -> None:
    """A link_trace.jsonl of two clusters sending `rate_bps` through a busy shaper for 3 s, and the summary again."""
    lines = [{"kind": "start", "t0_monotonic": 1.0, "t0_wall": 1.8e9, "clusters": 2}]
    for i in range(31):
        sent = round(rate_bps / 8 * i * 0.1)
        lines.append({"kind": "sample", "t_s": i * 0.1, "tx_bytes": [sent, sent], "backlog_bytes": [3028, 3028],
                      "trace_rate_bps": 40e6, "trace_delay_ms": 15.0})  # fmt: skip
    (run_dir / "link_trace.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = summarize(RunConfig.load(run_dir / "config.json"), run_dir, None, {})
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_harness_plot_draws_it_for_a_run_that_replayed_a_trace_and_for_no_other(tmp_path):
    root = tmp_path / "runs"
    traced = write_run(root, "traced", profile="trace-consumer-uplink")
    with_link_trace(traced, rate_bps=38e6)
    write_run(root, "plain", profile="100mbps")
    tables = load_runs([root])
    assert set(tables.link_trace["run_id"]) == {tables.runs.set_index("path").loc["runs/traced", "run_id"]}
    assert tables.runs["link_trace_windows"].max() == 6  # 3 windows of 1 s on each of two clusters
    result = CliRunner().invoke(main, ["plot", str(root), "--out", str(tmp_path / "figures")])
    assert result.exit_code == 0, result.output
    figures = sorted((tmp_path / "figures").glob("link-trace-*"))
    assert [p.suffix for p in figures] == [".png", ".svg"]
    assert figures[0].read_bytes()[:8] == PNG_MAGIC
    svg = figures[1].read_text()
    # The shipped trace holds 40 Mbit/s for 2 s, then 35: 38 Mbit/s errs by 38 / 35 - 1 in the third second.
    assert "link_trace_error 0.086 over 6 busy windows" in svg
    assert "trace rate" in svg and "the trace's, replayed" in svg
