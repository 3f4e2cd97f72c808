"""`--set checkpoint_every=N` and `--resume` refused where they cannot work, in one sentence with nothing created,
and an interrupted run's events rewound to its checkpoint (harness/run/resume.py). The real resume:
test_resume_e2e.py."""

from __future__ import annotations

import json

import pytest

from harness.run.folder import RunFolder, RunPaths
from harness.run.resume import rewind_events
from tests.harness.fakeruns import write_run
from tests.harness.refusal import RunStarted, assert_refused, flat
from trainers.checkpoint import mark_complete, save_rank


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--method", "cocktail", "--set", "checkpoint_every=5"], ["method cocktail cannot be checkpointed"]),
        (
            ["--method", "dilocox", "--set", "overlap=delayed", "--set", "checkpoint_every=5"],
            ["overlap=delayed keeps a round's exchange in flight", "overlap=streaming or none"],
        ),
        (
            ["--steps", "20", "--set", "checkpoint_every=20"],
            ["would save nothing in a run of 20 steps", "fewer than 20"],
        ),
        (["--set", "checkpoint_every=-1"], ["checkpoint_every must be 0 (off) or a positive number of steps"]),
    ],
)
def test_checkpoints_a_run_cannot_take_are_refused(harness_cli, argv, words):
    result, before, after = harness_cli(["run", "--profile", "1gbps", *argv])
    assert_refused(result, before, after, words)


def _interrupted(root, checkpoint_step: int | None = 10, status: str = "failed"):
    """A run folder as a failed run leaves it, with a complete checkpoint at `checkpoint_step` (None: none)."""
    run = write_run(root, "run", failure="rank 1 (cluster 1, stage 0) was killed by SIGKILL" if status else None)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "status": status}))
    if checkpoint_step is not None:
        checkpoints = RunPaths(run).checkpoints
        for rank in (0, 1):
            save_rank(checkpoints, checkpoint_step, rank, {"x": rank})
        mark_complete(checkpoints, checkpoint_step)
    return run


@pytest.mark.parametrize(
    ("make", "extra", "words"),
    [
        (lambda root: root / "nosuch", [], ["is not a run folder"]),
        (lambda root: _interrupted(root, status="ok"), [], ["finished; there is nothing to resume"]),
        (lambda root: _interrupted(root, checkpoint_step=None), [], ["has no complete checkpoint", "--config"]),
        (lambda root: _interrupted(root), ["--steps", "50"], ["leave out --steps"]),
    ],
)
def test_a_run_that_cannot_be_resumed_is_refused(harness_cli, tmp_path, make, extra, words):
    run = make(tmp_path / "runs")
    result, before, after = harness_cli(["run", "--resume", str(run), *extra])
    assert_refused(result, before, after, words)


def test_a_resumable_run_reaches_the_run_from_its_folder_or_its_staging_name(harness_cli, tmp_path):
    run = _interrupted(tmp_path / "runs")
    for given in (run, run.parent / f".{run.name}.partial"):
        result, _, _ = harness_cli(["run", "--resume", str(given)])
        assert isinstance(result.exception, RunStarted), flat(result.output)
        assert RunFolder.interrupted(given).final == run


def test_events_are_rewound_to_the_checkpoint(tmp_path):
    paths = RunPaths(tmp_path)
    paths.events_dir.mkdir()
    events = [
        {"kind": "start"},
        {"kind": "eval", "step": 0},
        *({"kind": "step", "step": s} for s in range(14)),
        {"kind": "eval", "step": 10},
        {"kind": "checkpoint", "step": 10},
        {"kind": "finish", "step": 12},
        {"kind": "error", "error": "killed"},
    ]
    lines = [json.dumps(e) for e in events]
    # A line the kill cut short.
    paths.events(0).write_text("\n".join(lines) + '\n{"kind": "st')
    rewind_events(paths, 10)
    kept = [json.loads(line) for line in paths.events(0).read_text().splitlines()]
    assert kept == [e for e in events[:12]] + [{"kind": "eval", "step": 10}, {"kind": "checkpoint", "step": 10}]
