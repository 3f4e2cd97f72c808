"""The tidy tables (harness/analysis/report/tables.py) read from run folders with known (made-up) numbers, and what a
damaged run folder does to them."""

from __future__ import annotations

import json
import shutil

import pytest

from harness.analysis.report.tables import Skipped, load_runs, skipped_note
from harness.run.folder import ResultsError, UnreadableResults
from tests.harness.fakeruns import DAMAGE, EVAL_S, damage, write_run


def test_tidy_tables_have_one_row_per_run_and_per_event(sweep_results):
    tables = load_runs([sweep_results])
    assert len(tables.runs) == 7
    assert set(tables.runs["status"]) == {"ok", "failed"}
    assert set(tables.runs["variant"]) == {"allreduce", "opendiloco (local_steps=10)", "local"}
    # Paths are relative to the folder named, so copied sweep_results report the same.
    assert set(tables.runs["path"]) >= {"sweep/runs/ar-s0", "sweep/runs/local-s0"}
    # 2 ranks x (20 steps + 3 evals) per run.
    assert (tables.events.groupby("run_id").size() == 2 * 23).all()
    assert set(tables.events["kind"]) == {"step", "eval"}


def test_elapsed_time_leaves_evaluation_out(sweep_results):
    events = load_runs([sweep_results / "runs" / "ar-s0"]).events
    rank0 = events[events["rank"] == 0]
    step_s = 2048 / 1000
    last_step = rank0[(rank0["kind"] == "step") & (rank0["step"] == 19)].iloc[0]
    assert last_step["elapsed_s"] == pytest.approx(20 * step_s)
    final_eval = rank0[(rank0["kind"] == "eval") & (rank0["step"] == 20)].iloc[0]
    assert final_eval["elapsed_s"] == pytest.approx(20 * step_s)
    middle_eval = rank0[(rank0["kind"] == "eval") & (rank0["step"] == 10)].iloc[0]
    assert middle_eval["elapsed_s"] == pytest.approx(10 * step_s)
    assert EVAL_S > 0  # the fake run did spend time evaluating, which elapsed_s must not count


def test_compute_utilisation_uses_the_median_compute_after_warm_up_and_the_slowest_stage(tmp_path):
    # 2048 tokens per step at 1000 tokens/s; warm-up steps (0-4) compute slowly and must not count.
    def compute(rank, step):
        if step < 5:
            return 10.0
        return (0.8, 1.0, 1.2)[step % 3] * (1.5 if rank % 2 else 1.0)

    write_run(tmp_path, "flat", "local", tokens_per_s=1000, compute_s=compute)
    write_run(tmp_path, "piped", "local", tokens_per_s=1000, compute_s=compute, options={"stages": 2})
    runs = load_runs([tmp_path]).runs
    runs.index = runs["path"].str.rsplit("/", n=1).str[-1]
    # Median after warm-up: 1.0 s on rank 0; ceiling 2048 tokens/s.
    assert runs.loc["flat", "compute_ceiling_tokens_per_s"] == pytest.approx(2048)
    assert runs.loc["flat", "compute_utilisation"] == pytest.approx(1000 / 2048)
    # Two stages: rank 1 (stage 1) is 1.5x slower and sets the pace.
    assert runs.loc["piped", "compute_ceiling_tokens_per_s"] == pytest.approx(2048 / 1.5)
    assert runs.loc["piped", "compute_utilisation"] == pytest.approx(1.5 * 1000 / 2048)


def test_report_runs_on_results_copied_elsewhere(sweep_results, tmp_path):
    copy = tmp_path / "elsewhere" / "copied"
    shutil.copytree(sweep_results, copy)
    shutil.rmtree(sweep_results)
    tables = load_runs([copy])
    assert set(tables.runs["path"]) >= {"copied/runs/ar-s0"}
    assert len(tables.runs) == 7


def test_no_runs_is_a_clear_error(tmp_path):
    with pytest.raises(ResultsError, match="no run folders"):
        load_runs([tmp_path])


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_summary_leaves_that_run_out_and_names_it(sweep_results, how):
    bad = sweep_results / "runs" / "dl-s1" / "summary.json"
    why = damage(bad, how)
    tables = load_runs([sweep_results])
    assert len(tables.runs) == 6 and "sweep/runs/dl-s1" not in set(tables.runs["path"])
    assert tables.skipped == (Skipped(bad, tables.skipped[0].why),) and why in tables.skipped[0].why
    assert skipped_note(tables.skipped) == f"skipped 1 unreadable run: {bad}: {tables.skipped[0].why}"


@pytest.mark.parametrize(
    ("line", "why"),
    [("[1, 2]", "line 25: a JSON list, not an object"), ('{"t": 1.0, "kind": "step", "step": 3}', "lacks step_s")],
)
def test_a_damaged_events_file_leaves_that_run_out(sweep_results, line, why):
    events = sweep_results / "runs" / "ar-s1" / "events" / "rank1.jsonl"
    events.write_text(events.read_text() + line + "\n")
    tables = load_runs([sweep_results])
    assert len(tables.runs) == 6 and set(tables.events["run_id"]) == set(tables.runs["run_id"])
    (skipped,) = tables.skipped
    assert skipped.path == events and why in skipped.why


def test_nothing_readable_is_one_error_naming_the_files(sweep_results):
    damage(sweep_results / "runs" / "ar-s0" / "summary.json", "empty")
    with pytest.raises(UnreadableResults, match=r"ar-s0/summary.json: empty; run it again"):
        load_runs([sweep_results / "runs" / "ar-s0"])
    for run in ("ar-s1", "dl-s0"):
        damage(sweep_results / "runs" / run / "summary.json", "truncated")
    parts = [sweep_results / "runs" / run for run in ("ar-s0", "ar-s1", "dl-s0")]
    with pytest.raises(ResultsError, match="none of the 3 run folders under .* is readable .*skipped 3 unreadable"):
        load_runs(parts)


def test_a_run_folder_without_its_summary_is_named_not_dropped_unsaid(sweep_results):
    """It was left out silently: n fell from 2 to 1 and the report exited 0 without a word."""
    lost = sweep_results / "runs" / "dl-s1"
    (lost / "summary.json").unlink()
    tables = load_runs([sweep_results])
    assert len(tables.runs) == 6 and "sweep/runs/dl-s1" not in set(tables.runs["path"])
    assert tables.skipped == (Skipped(lost, "no summary.json (the run did not finish writing it)"),)
    assert f"skipped 1 unreadable run: {lost}: no summary.json" in skipped_note(tables.skipped)


def test_validation_tokens_of_a_run_from_before_the_summary_recorded_them(tmp_path):
    """Older runs record neither val_tokens nor eval_s: they are read from config.json (where seq_len was given)
    and from the evaluation events."""
    run = write_run(tmp_path, "old", "allreduce", options={"seq_len": 64, "eval_batches": 256})
    summary = json.loads((run / "summary.json").read_text())
    del summary["val_tokens"], summary["eval_s"]
    (run / "summary.json").write_text(json.dumps(summary))
    old = load_runs([tmp_path]).runs.iloc[0]
    assert old["val_tokens"] == 256 * 8 * 64 and old["eval_s"] == pytest.approx(3 * EVAL_S)
