"""TensorBoard event files from a run's events (harness/run/tensorboard.py), read back with tensorboard's own reader."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from harness.errors import UserError  # noqa: E402
from harness.run.tensorboard import LiveScalars, RunScalars, check_log_dir, write_run, write_runs  # noqa: E402

RATE_BPS = 1_000_000
CONFIG = {"clusters": 2, "stages": 2, "profile": {"inter_cluster": {"rate_bps": RATE_BPS}}}


def _scalars(log_dir) -> dict[str, list[tuple[int, float, float]]]:
    """tag -> [(step, value, wall time)]."""
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _step(rank: int, step: int, loss: float, **fields) -> dict:
    return {"t": 1000.0 + step, "rank": rank, "kind": "step", "step": step, "tokens": 512 * (step + 1), "loss": loss,
            "lr": 0.1, "step_s": 2.0, **fields}  # fmt: skip


def _eval(rank: int, step: int, t: float, val_loss: float, **fields) -> dict:
    return {"t": t, "rank": rank, "kind": "eval", "step": step, "tokens": 512 * step, "val_loss": val_loss,
            "eval_s": 0.5, **fields}  # fmt: skip


def _events() -> dict[int, list[dict]]:
    """Two clusters of two stages: rank 0 and 2 are first stages (the uplinks), 1 and 3 the last (the losses)."""
    start = {"t": 999.0, "kind": "start", "tokens_per_step": 512}
    return {
        0: [
            {**start, "rank": 0},
            _step(0, 0, 9.0, wire_bytes=0),
            _step(
                0,
                1,
                9.0,
                wire_bytes=250_000,
                sync_payload_bytes=240_000,
                sync_blocked_s=0.5,
                sync_overlapped_s=0.0,
                sync_rank_r=64,
                sync_cosine=None,
            ),
            {
                "t": 1002.5,
                "rank": 0,
                "kind": "finish",
                "step": 1,
                "sync_payload_bytes": 1000,
                "sync_blocked_s": 0.1,
                "sync_overlapped_s": 0.0,
            },
        ],
        1: [
            {**start, "rank": 1},
            _eval(1, 0, 999.5, 5.5, val_bpb=7.9),
            _step(1, 0, 5.0),
            _step(1, 1, 4.0),
            _eval(1, 2, 1002.0, 3.5, val_bpb=5.0),
        ],
        2: [_step(2, 0, 8.0, wire_bytes=0), _step(2, 1, 8.0, wire_bytes=1)],
        3: [_step(3, 0, 7.0), _step(3, 1, 6.0), _eval(3, 2, 1003.0, 9.0)],
    }


def test_the_scalars_are_the_runs_figures(tmp_path):
    scalars = RunScalars(tmp_path, CONFIG)
    for rank, events in _events().items():
        for event in events:
            scalars.add(rank, event)
    scalars.close()
    got = _scalars(tmp_path)
    # The last stages' losses, averaged over the clusters; the first stages' are not losses of the model.
    assert [(s, v) for s, v, _ in got["train/loss"]] == [(0, 6.0), (1, 5.0)]
    # Cluster 0's evaluations (every cluster evaluates the same synchronized weights), at their step and time.
    assert got["val/loss"] == [(0, 5.5, 999.5), (2, 3.5, 1002.0)]
    assert [v for _, v, _ in got["val/bits_per_byte"]] == pytest.approx([7.9, 5.0])
    assert [v for _, v, _ in got["train/tokens_per_s"]] == [256.0, 256.0]
    assert [v for _, v, _ in got["link/wire_bytes"]] == [0, 250_000]
    assert [v for _, v, _ in got["link/send_bps"]] == [0, 1_000_000]
    assert [v for _, v, _ in got["link/utilization"]] == [0, 1.0]
    # Every numeric field of an exchange, the last one drained in finish() included; None is not a scalar.
    assert [(s, v) for s, v, _ in got["sync/payload_bytes"]] == [(1, 240_000), (1, 1000)]
    assert [v for _, v, _ in got["sync/rank_r"]] == [64]
    assert "sync/cosine" not in got


def test_a_loss_is_written_only_once_every_cluster_logged_its_step(tmp_path):
    scalars = RunScalars(tmp_path, CONFIG)
    scalars.add(1, _step(1, 0, 5.0))
    scalars.add(1, _step(1, 1, 4.0))
    scalars.add(3, _step(3, 0, 7.0))
    scalars.close()
    assert [(s, v) for s, v, _ in _scalars(tmp_path)["train/loss"]] == [(0, 6.0)]


def _run_folder(root, events: dict[int, list[dict]]):
    (root / "events").mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(CONFIG))
    for rank, rank_events in events.items():
        (root / "events" / f"rank{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in rank_events))
    return root


def test_live_polling_writes_what_a_finished_run_folder_gives(tmp_path):
    run = _run_folder(tmp_path / "run", _events())
    write_run(run, tmp_path / "after")
    live = LiveScalars(run, [RunScalars(tmp_path / "live", CONFIG)], CONFIG)
    live.poll()
    # Lines appended after a poll are read by the next one, or by close.
    with (run / "events" / "rank1.jsonl").open("a") as f:
        f.write(json.dumps(_eval(1, 4, 1004.0, 3.0)) + "\n")
    live.close()
    after, during = _scalars(tmp_path / "after"), _scalars(tmp_path / "live")
    assert during["val/loss"] == after["val/loss"] + [(4, 3.0, 1004.0)]
    assert {k: v for k, v in during.items() if k != "val/loss"} == {k: v for k, v in after.items() if k != "val/loss"}


def test_runs_are_written_side_by_side(tmp_path):
    runs = [(_run_folder(tmp_path / name, _events()), f"sweep/{name}") for name in ("a", "b")]
    write_runs(runs, tmp_path / "tb")
    assert sorted(p.name for p in (tmp_path / "tb" / "sweep").iterdir()) == ["a", "b"]
    assert (
        _scalars(tmp_path / "tb" / "sweep" / "b")["val/loss"] == _scalars(tmp_path / "tb" / "sweep" / "a")["val/loss"]
    )


def test_a_folder_that_already_holds_files_is_refused(tmp_path):
    (tmp_path / "tb").mkdir()
    check_log_dir(tmp_path / "tb")
    (tmp_path / "tb" / "old").write_text("")
    with pytest.raises(UserError, match="already exists and is not an empty folder; pass a new folder"):
        check_log_dir(tmp_path / "tb")


def test_without_the_tensorboard_package_the_flag_is_refused_before_the_run(monkeypatch):
    from harness.run.config import RunConfig
    from harness.run.tensorboard import check_available

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(UserError, match=r"--tensorboard needs the tensorboard package; install it with pip install"):
        check_available()
    with pytest.raises(UserError, match="--tensorboard needs the tensorboard package"):
        RunConfig.build("allreduce", "1gbps", tensorboard=True).validate()
    RunConfig.build("allreduce", "1gbps").validate()
