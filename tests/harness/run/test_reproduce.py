"""`harness reproduce`: what it refuses, what it warns of, and the side-by-side it prints (the rerun itself is real
in test_reproduce_e2e.py)."""

from __future__ import annotations

import json

import pytest

from harness.errors import UserError
from harness.run.folder import RunPaths
from harness.run.reproduce import figures, prepare
from harness.run.summary import checkout_commit
from tests.harness.fakeruns import write_run


def _with_environment(run, **fields):
    (run / "environment.json").write_text(json.dumps({"git_commit": checkout_commit(), "git_dirty": False, **fields}))
    return run


def test_a_folder_without_a_finished_run_is_refused_in_one_sentence(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no config.json; give a run folder"):
        prepare(tmp_path / "empty")
    failed = write_run(tmp_path, "failed", failure="rank 1 killed by SIGKILL")
    with pytest.raises(UserError, match="holds no finished run .* `harness run --config` reruns its config"):
        prepare(failed)
    unsummarized = write_run(tmp_path, "unsummarized")
    RunPaths(unsummarized).summary.unlink()
    with pytest.raises(UserError, match="holds no finished run"):
        prepare(unsummarized)


def test_a_damaged_summary_is_refused_naming_the_file(tmp_path):
    run = write_run(tmp_path, "damaged")
    RunPaths(run).summary.write_text('{"status": "ok", "tokens_per_s"')
    with pytest.raises(UserError, match=r"summary\.json: .*; reproduce a run whose summary\.json is intact"):
        prepare(run)


def test_the_rerun_is_the_stored_config_and_what_may_differ_is_said(tmp_path):
    run = _with_environment(write_run(tmp_path, "r", method="dilocox", options={"rank": 8}), hostname="elsewhere")
    reproduction = prepare(run)
    stored = json.loads((run / "config.json").read_text())
    assert reproduction.config.method == "dilocox" and reproduction.config.run_key != stored["run_key"]
    assert reproduction.config.resolved_options == stored["method_options"]
    assert reproduction.config.train.steps == stored["train"]["steps"]
    assert any("made on elsewhere" in w for w in reproduction.warnings)
    assert not any("made at commit" in w for w in reproduction.warnings)
    other = _with_environment(write_run(tmp_path, "old"), git_commit="0" * 40)
    assert any(f"made at commit {'0' * 12} and this checkout is at" in w for w in prepare(other).warnings)


def test_a_changed_input_refuses_the_rerun(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the text as it was\n" * 300)
    run = write_run(tmp_path, "r", options={"data": str(corpus)})
    corpus.write_text("the text as it is now\n" * 300)
    with pytest.raises(UserError, match=f"{corpus} has changed since the run in"):
        prepare(run)


def test_identical_runs_read_identical_and_the_first_difference_is_named(tmp_path):
    stored = _with_environment(write_run(tmp_path, "stored", tokens_per_s=1000.0))
    same = write_run(tmp_path, "same", tokens_per_s=800.0, wire_bytes_per_token=100.05)
    reproduction = prepare(stored)
    rows = {row.name: row for row in figures(reproduction, json.loads(RunPaths(same).summary.read_text()), same)}
    assert rows["training loss, every step"].verdict == "identical on every rank"
    assert rows["final val loss"].verdict == "identical"
    assert rows["tokens/s"].verdict == "x 0.800"
    assert rows["wire bytes"].verdict == "x 1.00050 (within 0.1%)"

    changed = write_run(tmp_path, "changed", val_losses=(5.5, 4.5, 3.9), wire_bytes_per_token=100.2)
    events = [json.loads(line) for line in RunPaths(changed).events(1).read_text().splitlines()]
    seventh = [e for e in events if e["kind"] == "step"][6]
    seventh["loss"] += 1e-6
    RunPaths(changed).events(1).write_text("".join(json.dumps(e) + "\n" for e in events))
    rows = {row.name: row for row in figures(reproduction, json.loads(RunPaths(changed).summary.read_text()), changed)}
    assert rows["training loss, every step"].verdict == "first differs at step 7 on rank 1; 1 of 40 (step, rank) differ"
    assert rows["final val loss"].verdict == "differs by -0.100000 (-2.500%)"
    assert rows["wire bytes"].verdict == "x 1.00200 (NOT within 0.1%)"
