"""A run stopped after a checkpoint and resumed from it trains exactly as if it had never stopped: the real train
loop (trainers/train.py) on two ranks over gloo, the tiny model on the default corpus, every resumable method."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from tests.trainers.spawn import run_ranks
from trainers.checkpoint import latest_complete, load_rank, mark_complete, save_rank, step_dir
from trainers.config import TrainConfig
from trainers.registry import method_class, method_config
from trainers.train import Checkpointing, ParallelContext, train

STEPS, EVERY, STOP_AFTER = 16, 4, 11
CONFIG = TrainConfig(model="tiny", steps=STEPS, batch_size=2, seq_len=64, eval_every=4, eval_batches=1)
# Every resumable method (local's state is allreduce's: the base class's), and DiLoCoX's variants whose state
# differs: the default (gather, streaming, adaptive: error feedback, warm-start Q, the rank window) and the
# shared-basis reduce. DiLoCoX's exchange runs behind each round's last 2 steps, where no checkpoint can be taken:
# one falls due there and waits for the round's end.
CASES = {
    "allreduce": ("allreduce", {}),
    "opendiloco": ("opendiloco", {"local_steps": 5}),
    "dilocox": ("dilocox", {"local_steps": 5, "overlap_steps": 2, "rank": 8}),
    "dilocox-reduce": ("dilocox", {"local_steps": 5, "overlap_steps": 2, "rank": 8, "exchange": "reduce"}),
    "sparseloco": ("sparseloco", {"local_steps": 5}),
    "demo": ("demo", {}),
}


class _Stop(Exception):
    pass


def _run(name: str, options: dict, rank: int, group, checkpoints: Checkpointing | None, stop_after: int | None):
    """One run's step losses and end figures on this rank; stopped (as a killed run is) after `stop_after` steps."""
    par = ParallelContext(
        rank=rank, cluster=rank, clusters=2, stage=0, stages=1, pipeline_group=None, data_parallel_group=group
    )
    events = []

    def log(event: dict) -> None:
        events.append(event)
        if stop_after is not None and event["kind"] == "step" and event["step"] == stop_after - 1:
            raise _Stop

    try:
        result = train(CONFIG, name, method_config(name, options), par, log, None, checkpoints)
    except _Stop:
        result = None
    return {"events": events, "result": result}


def _scenario(rank: int, root: str, case: str) -> dict:
    group = dist.new_group([0, 1])
    name, options = CASES[case]
    checkpoints = Checkpointing(Path(root) / case, EVERY)
    whole = _run(name, options, rank, group, None, None)
    stopped = _run(name, options, rank, group, checkpoints, STOP_AFTER)
    dist.barrier()
    resumed = _run(name, options, rank, group, checkpoints, None)
    return {"whole": whole, "stopped": stopped, "resumed": resumed}


@pytest.fixture
def runs(tmp_path, case):
    """The case's three runs on each of two ranks, spawned for its test alone (forked ranks start in well under a
    second; a fixture of every case would run them all on each test worker that took one of them)."""
    return run_ranks(_scenario, (str(tmp_path), case), tmp_path)


def _steps(events: list[dict]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events if e["kind"] == "step"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_run_trains_bit_for_bit_as_the_uninterrupted_one(runs, case):
    for rank, run in enumerate(runs):
        whole, stopped, resumed = run["whole"], run["stopped"], run["resumed"]
        saved = [e["step"] for e in stopped["events"] if e["kind"] == "checkpoint"]
        # Saved at the interval (DiLoCoX: at the first step after it with nothing in flight), before the stop.
        assert saved and all(step <= STOP_AFTER for step in saved), saved
        if case.startswith("dilocox"):
            assert saved[0] == 5, "due at 4, inside the exchange of round 1's last 2 steps: taken at its end"
        else:
            assert saved == [4, 8]
        (resume,) = [e for e in resumed["events"] if e["kind"] == "resume"]
        assert resume["step"] == saved[-1]
        # The resumed run starts where the checkpoint was and redoes the steps lost after it, exactly.
        losses, again = _steps(whole["events"]), _steps(resumed["events"])
        assert min(again) == saved[-1] and max(again) == STEPS - 1
        assert {step: losses[step] for step in again} == again, (case, rank)
        evals = {e["step"]: e["val_loss"] for e in whole["events"] if e["kind"] == "eval"}
        assert {e["step"]: e["val_loss"] for e in resumed["events"] if e["kind"] == "eval"} == {
            step: loss for step, loss in evals.items() if step > saved[-1]
        }
        for key in ("final_val_loss", "final_train_loss", "applied_tokens", "optimizer_state_bytes"):
            assert resumed["result"][key] == whole["result"][key], key
        assert resumed["result"]["resumed_at_step"] == saved[-1]
        # Its throughput window is its own: the steps since it resumed, after their warm-up.
        first = saved[-1] + CONFIG.throughput_warmup_steps
        assert resumed["result"]["window_steps"] == STEPS - first


def test_every_built_in_method_but_cocktail_is_resumable():
    # CocktailSGD keeps a step's exchange in flight into the next step, always: no step is free to checkpoint.
    resumable = {
        name
        for name in ("allreduce", "local", "opendiloco", "dilocox", "sparseloco", "demo", "cocktail")
        if method_class(name).resumable
    }
    assert resumable == {"allreduce", "local", "opendiloco", "dilocox", "sparseloco", "demo"}


def test_dilocox_refuses_checkpoints_where_an_exchange_is_always_in_flight():
    for overlap in ("delayed", "eager"):
        assert "overlap=streaming" in method_config("dilocox", {"overlap": overlap}).checkpoint_refusal()
    for overlap in ("streaming", "none"):
        assert method_config("dilocox", {"overlap": overlap}).checkpoint_refusal() is None


def test_only_a_step_every_rank_finished_saving_is_resumed_and_older_ones_go(tmp_path):
    save_rank(tmp_path, 5, 0, {"x": 1})
    mark_complete(tmp_path, 5)
    save_rank(tmp_path, 10, 0, {"x": 2})  # rank 1 never saved step 10: the run was killed meanwhile
    assert latest_complete(tmp_path) == 5
    assert load_rank(tmp_path, 5, 0) == {"x": 1}
    save_rank(tmp_path, 10, 1, {"x": 3})
    mark_complete(tmp_path, 10)
    assert latest_complete(tmp_path) == 10 and not step_dir(tmp_path, 5).exists()
    assert latest_complete(tmp_path / "none") is None
