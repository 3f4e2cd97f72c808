"""The run folder's layout and its readers (harness/run/folder.py): every damaged file is one UnreadableResults that
names the file, never a traceback from deep inside a report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.run.folder import (
    ResultsError,
    RunFolder,
    RunPaths,
    UnreadableResults,
    find_run_dirs,
    read_config,
    read_events,
    read_rank_result,
    read_summary,
    write_rank_result,
)
from tests.harness.fakeruns import DAMAGE, damage, write_run


@pytest.fixture
def run(tmp_path) -> Path:
    return write_run(tmp_path, "run")


def test_the_layout_is_spelled_out_once():
    paths = RunPaths(Path("out"))
    assert (paths.config, paths.environment, paths.summary, paths.link_check) == (
        Path("out/config.json"), Path("out/environment.json"), Path("out/summary.json"), Path("out/link_check.json"),
    )  # fmt: skip
    assert (paths.events(3), paths.faults) == (Path("out/events/rank3.jsonl"), Path("out/events/faults.jsonl"))
    assert (paths.rank_result(3), paths.log(3)) == (Path("out/ranks/rank3.json"), Path("out/logs/rank3.log"))
    assert RunFolder(Path("runs/x")).paths == RunPaths(Path("runs/.x.partial"))


def test_a_finished_run_reads_back(run):
    assert read_summary(run)["method"] == "allreduce"
    assert read_config(run)["method"] == "allreduce"
    assert read_rank_result(run, 0)["final_val_loss"] == 4.0 and read_rank_result(run, 7) is None
    assert [e["kind"] for e in read_events(run, 0)][:3] == ["start", "eval", "step"]
    assert read_events(run, 7) == [] and RunPaths(run).event_ranks() == [0, 1]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_summary_is_one_sentence_naming_the_file(run, how):
    why = damage(RunPaths(run).summary, how)
    with pytest.raises(UnreadableResults) as err:
        read_summary(run)
    assert err.value.path == RunPaths(run).summary and why in err.value.why
    assert str(err.value).startswith(f"{run / 'summary.json'}: {why}")
    assert str(err.value).endswith("; run it again (resuming its sweep redoes it) or remove its run folder")
    assert isinstance(err.value, ResultsError)


def test_a_missing_or_unreadable_file_says_so(run):
    RunPaths(run).summary.unlink()
    with pytest.raises(UnreadableResults, match="summary.json: missing"):
        read_summary(run)
    (run / "config.json").write_text("{} {}")
    with pytest.raises(UnreadableResults, match=r"config.json: not valid JSON \(Extra data at line 1, column 4\)"):
        read_config(run)


def _append(run: Path, line: str, rank: int = 0) -> None:
    with RunPaths(run).events(rank).open("a") as f:
        f.write(line)


def test_only_a_last_line_cut_short_is_skipped(run):
    whole = read_events(run, 0)
    _append(run, '{"t": 1.0, "kind": "st')
    assert read_events(run, 0) == whole
    _append(run, '\n{"t": 2.0, "kind": "end"}\n')
    lines = len(RunPaths(run).events(0).read_text().splitlines())
    with pytest.raises(UnreadableResults, match=rf"rank0.jsonl: line {lines - 1}: cut short"):
        read_events(run, 0)


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("[1, 2]", "a JSON list, not an object"),
        ('{"t": 1.0, "kind": "step", "step": 3, "tokens": 100}', "lacks step_s"),
        ('{"t": 1.0, "kind": "eval", "step": 3, "tokens": 100, "eval_s": 0.1}', "lacks val_loss"),
        ('{"kind": "error", "error": "boom"}', "lacks t"),
        ('{"t": 1.0, "kind": "finish", "sync_payload_bytes": 10}', "lacks sync_blocked_s, sync_overlapped_s"),
    ],
)
def test_an_events_line_that_is_not_an_event_names_its_line(run, line, why):
    lines = len(RunPaths(run).events(1).read_text().splitlines())
    _append(run, line + "\n", rank=1)
    with pytest.raises(UnreadableResults) as err:
        read_events(run, 1)
    assert str(err.value).startswith(f"{RunPaths(run).events(1)}: line {lines + 1}: {why}")


@pytest.mark.parametrize("content", [b"\x00\x01\xff", bytes(4096)])
def test_a_binary_events_file_is_refused(run, content):
    RunPaths(run).events(0).write_bytes(content)
    with pytest.raises(UnreadableResults, match="rank0.jsonl: binary, not JSON text"):
        read_events(run, 0)


def test_a_rank_result_is_written_whole(tmp_path):
    write_rank_result(tmp_path, 2, {"tokens": 5})
    assert read_rank_result(tmp_path, 2) == {"tokens": 5}
    assert sorted(p.name for p in RunPaths(tmp_path).ranks_dir.iterdir()) == ["rank2.json"]


def test_find_run_dirs_keeps_a_sweeps_own_finished_runs(tmp_path):
    sweep = tmp_path / "sweep"
    write_run(sweep / "runs", "a")
    write_run(sweep / "runs", ".b.partial")
    write_run(sweep / "regime", "compute")
    (sweep / "sweep.json").write_text(json.dumps({"settings": {}}))
    assert find_run_dirs([sweep]) == [(sweep / "runs" / "a", "sweep/runs/a")]
    assert find_run_dirs([sweep / "runs" / "a"]) == [(sweep / "runs" / "a", "a")]
    with pytest.raises(ResultsError, match="no run folders"):
        find_run_dirs([tmp_path / "sweep" / "runs" / ".b.partial" / "events"])
    with pytest.raises(ResultsError, match="is neither a run folder nor a folder of runs"):
        find_run_dirs([sweep / "sweep.json"])
