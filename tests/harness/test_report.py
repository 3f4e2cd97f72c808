"""The report's tables and arithmetic, on run folders with known (made-up) numbers."""

from __future__ import annotations

import math
import shutil

import pandas as pd
import pytest
from click.testing import CliRunner

from harness import report
from harness.cli import main
from harness.report import ReportError, comparison, load_runs, markdown
from tests.harness.fakeruns import EVAL_S, write_run


@pytest.fixture
def results(tmp_path):
    """Two seeds each of allreduce, opendiloco (H=10) and local on 1gbps; one allreduce on 100mbps; one failure."""
    root = tmp_path / "sweep" / "runs"
    h10 = {"local_steps": 10}
    for name, method, seed, tokens_per_s, wire, losses, options in (
        ("ar-s0", "allreduce", 0, 1000, 400, (5.5, 4.4, 4.0), {}),
        ("ar-s1", "allreduce", 1, 1200, 400, (5.5, 4.2, 3.8), {}),
        ("dl-s0", "opendiloco", 0, 5500, 4, (5.5, 4.6, 4.1), h10),
        ("dl-s1", "opendiloco", 1, 5500, 4, (5.5, 4.8, 4.3), h10),
        ("local-s0", "local", 0, 11000, 0, (5.5, 5.0, 4.9), {}),
    ):
        write_run(root, name, method, seed=seed, tokens_per_s=tokens_per_s, wire_bytes_per_token=wire,
                  val_losses=losses, options=options)  # fmt: skip
    write_run(root, "ar-100", "allreduce", profile="100mbps", tokens_per_s=300, val_losses=(5.5, 4.4, 4.0))
    write_run(root, "broken", "opendiloco", failure="rank 1 exited with code 1", options=h10)
    return tmp_path / "sweep"


def row(table: pd.DataFrame, variant: str, profile: str = "1gbps") -> pd.Series:
    return table[(table["variant"] == variant) & (table["profile"] == profile)].iloc[0]


def test_tidy_tables_have_one_row_per_run_and_per_event(results):
    tables = load_runs([results])
    assert len(tables.runs) == 7
    assert set(tables.runs["status"]) == {"ok", "failed"}
    assert set(tables.runs["variant"]) == {"allreduce", "opendiloco local_steps=10", "local"}
    # Paths are relative to the folder named, so copied results report the same.
    assert set(tables.runs["path"]) >= {"sweep/runs/ar-s0", "sweep/runs/local-s0"}
    # 2 ranks x (20 steps + 3 evals) per run.
    assert (tables.events.groupby("run_id").size() == 2 * 23).all()
    assert set(tables.events["kind"]) == {"step", "eval"}


def test_elapsed_time_leaves_evaluation_out(results):
    events = load_runs([results / "runs" / "ar-s0"]).events
    rank0 = events[events["rank"] == 0]
    step_s = 2048 / 1000
    last_step = rank0[(rank0["kind"] == "step") & (rank0["step"] == 19)].iloc[0]
    assert last_step["elapsed_s"] == pytest.approx(20 * step_s)
    final_eval = rank0[(rank0["kind"] == "eval") & (rank0["step"] == 20)].iloc[0]
    assert final_eval["elapsed_s"] == pytest.approx(20 * step_s)
    middle_eval = rank0[(rank0["kind"] == "eval") & (rank0["step"] == 10)].iloc[0]
    assert middle_eval["elapsed_s"] == pytest.approx(10 * step_s)
    assert EVAL_S > 0  # the fake run did spend time evaluating, which elapsed_s must not count


def test_ratios_reductions_utilisation_and_losses(results):
    table = comparison(load_runs([results]))
    ar, dl, local = row(table, "allreduce"), row(table, "opendiloco local_steps=10"), row(table, "local")
    assert ar["tokens_per_s"] == pytest.approx(1100)
    assert ar["tokens_per_s_std"] == pytest.approx(math.sqrt(2 * 100**2))
    assert dl["ratio_to_allreduce"] == pytest.approx(5500 / 1100)
    assert ar["ratio_to_allreduce"] == pytest.approx(1.0)
    assert dl["wire_reduction"] == pytest.approx(100.0)
    assert dl["utilisation"] == pytest.approx(0.5)
    assert ar["utilisation"] == pytest.approx(0.1)
    assert local["utilisation"] == pytest.approx(1.0)
    assert dl["final_val_loss"] == pytest.approx(4.2)
    assert dl["final_val_loss_std"] == pytest.approx(math.sqrt(0.02))
    assert (ar["seeds"], ar["runs"]) == ("0,1", 2)


def test_default_target_is_reached_by_every_synchronized_run(results):
    table = comparison(load_runs([results]))
    ar, dl, local = row(table, "allreduce"), row(table, "opendiloco local_steps=10"), row(table, "local")
    # The highest final loss of the synchronized methods (opendiloco seed 1); local's unsynchronized loss is left out.
    assert ar["target_loss"] == pytest.approx(4.3)
    # allreduce seed 0 gets below 4.3 at step 20 (4.4, then 4.0), seed 1 at step 10 (4.2): tokens are averaged ...
    assert ar["reached"] == 2
    assert ar["tokens_to_target"] == pytest.approx((20 * 2048 + 10 * 2048) / 2)
    # ... opendiloco reaches it only at the end; time to target is training time, so 20 steps of 2048/5500 s.
    assert dl["tokens_to_target"] == pytest.approx(20 * 2048)
    assert dl["time_to_target_s"] == pytest.approx(20 * 2048 / 5500)
    assert local["reached"] == 0


def test_given_target_and_groups_per_profile(results):
    table = comparison(load_runs([results]), target_loss=4.0)
    assert set(table["target_loss"]) == {4.0}
    assert row(table, "allreduce")["reached"] == 2
    assert row(table, "opendiloco local_steps=10")["reached"] == 0
    # No allreduce partner on 100mbps for anything else, and no local there: utilisation is unknown.
    slow = row(table, "allreduce", "100mbps")
    assert slow["ratio_to_allreduce"] == pytest.approx(1.0) and math.isnan(slow["utilisation"])


def test_markdown_shows_the_comparison_and_the_failures(results):
    tables = load_runs([results])
    text = markdown(comparison(tables), tables.runs)
    assert "### 1gbps (1 Gbit/s) · model tiny" in text and "### 100mbps (100 Mbit/s)" in text
    line = next(x for x in text.splitlines() if x.startswith("| opendiloco local_steps=10"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:8] == ["0,1", "5,500 ± 0", "5x", "50%", "4.0", "100x", "4.200 ± 0.141"]
    assert "1 failed run(s)" in text and "sweep/runs/broken: rank 1 exited with code 1" in text


def test_report_runs_on_results_copied_elsewhere(results, tmp_path):
    copy = tmp_path / "elsewhere" / "copied"
    shutil.copytree(results, copy)
    shutil.rmtree(results)
    tables = load_runs([copy])
    assert set(tables.runs["path"]) >= {"copied/runs/ar-s0"}
    assert len(comparison(tables)) == 4


def test_no_runs_and_only_failed_runs_are_clear_errors(tmp_path):
    with pytest.raises(ReportError, match="no run folders"):
        load_runs([tmp_path])
    write_run(tmp_path, "broken", failure="rank 0 was killed by SIGKILL")
    with pytest.raises(ReportError, match="no successful runs"):
        comparison(load_runs([tmp_path]))


def test_parquet_without_an_engine_says_so(results, tmp_path, monkeypatch):
    monkeypatch.setattr(report, "parquet_engine", lambda: None)
    with pytest.raises(ReportError, match="parquet needs pyarrow or fastparquet"):
        report.write_parquet(comparison(load_runs([results])), tmp_path / "x.parquet")


def test_cli_prints_markdown_and_writes_tables(results, tmp_path, monkeypatch):
    monkeypatch.setattr(report, "parquet_engine", lambda: None)
    out = CliRunner().invoke(
        main, ["report", str(results), "--csv", str(tmp_path / "c.csv"), "--tables", str(tmp_path / "t")]
    )
    assert out.exit_code == 0, out.output
    assert "| allreduce" in out.output
    assert len(pd.read_csv(tmp_path / "c.csv")) == 4
    assert len(pd.read_csv(tmp_path / "t" / "runs.csv")) == 7
    assert (tmp_path / "t" / "events.csv").is_file()
    failed = CliRunner().invoke(main, ["report", str(results), "--parquet", str(tmp_path / "c.parquet")])
    assert failed.exit_code == 2 and "neither is installed" in failed.output
