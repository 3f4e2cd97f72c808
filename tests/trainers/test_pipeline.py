"""Pipeline stages against the unsplit model, in real processes talking gloo over loopback.

Every worker builds the `tiny` model from seed 0, so all ranks start from identical weights, and computes the
unsplit reference itself; the parent compares what the workers wrote to disk.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.trainers.spawn import run_ranks
from trainers.models import DecoderLM, get_model_config
from trainers.pipeline import PipelinedStage, WholeModel, build_stage, split_points, validate_pipeline

BATCH, SEQ, EVAL_BATCHES = 8, 16, 2
CASES = [("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4)]
LOSS_TOL, GRAD_RTOL = 1e-5, 1e-5


def test_split_points_are_as_even_as_possible():
    assert split_points(4, 1) == [0, 4]
    assert split_points(4, 2) == [0, 2, 4]
    assert split_points(4, 4) == [0, 1, 2, 3, 4]
    assert split_points(5, 2) == [0, 3, 5]
    assert split_points(6, 4) == [0, 2, 4, 5, 6]


@pytest.mark.parametrize("stages", [0, 5])
def test_split_points_rejects_impossible_cuts(stages):
    with pytest.raises(ValueError, match="use between 1 and 4 stages"):
        split_points(4, stages)


def test_validate_pipeline_accepts_sound_layouts():
    tiny = get_model_config("tiny")
    validate_pipeline(tiny, stages=2, microbatches=4, batch_size=8)
    validate_pipeline(tiny, stages=4, microbatches=4, batch_size=4)
    # One stage ignores micro-batches, and tied embeddings are fine when nothing is cut.
    validate_pipeline(tiny, stages=1, microbatches=0, batch_size=7)
    validate_pipeline(get_model_config("opt-125m"), stages=1, microbatches=0, batch_size=8)


@pytest.mark.parametrize(
    ("model", "stages", "microbatches", "batch_size", "message"),
    [
        ("tiny", 8, 8, 8, "--stages 8 exceeds the 4 layers of model 'tiny'; use at most 4"),
        ("tiny", 0, 1, 8, "--stages must be at least 1"),
        ("tiny", 2, 1, 8, "--microbatches 1 is fewer than --stages 2"),
        ("tiny", 2, 4, 6, "--batch-size 6 is not divisible by --microbatches 4"),
        ("opt-125m", 2, 2, 8, "the first and last stage would share one weight"),
    ],
)
def test_validate_pipeline_rejects(model, stages, microbatches, batch_size, message):
    with pytest.raises(ValueError, match=message):
        validate_pipeline(get_model_config(model), stages, microbatches, batch_size)


def test_build_stage_with_one_stage_is_the_whole_model():
    model = DecoderLM(get_model_config("tiny"))
    stage = build_stage(model, 0, 1, None, 1, "1f1b")
    assert isinstance(stage, WholeModel) and stage.module is model


def _cases(stages: int) -> list[tuple[str, int]]:
    """The (schedule, micro-batches) pairs a pipeline of `stages` accepts: every stage needs a micro-batch."""
    return [(schedule, microbatches) for schedule, microbatches in CASES if microbatches >= stages]


def _cluster_ranks(cluster: int, stages: int) -> list[int]:
    """Rank = cluster * stages + stage, as in harness/net/topology.py."""
    return list(range(cluster * stages, (cluster + 1) * stages))


def _batches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    vocab = get_model_config("tiny").vocab_size
    return [tuple(torch.randint(0, vocab, (2, BATCH, SEQ), generator=g)) for _ in range(n)]


def _run_case(
    stage_index: int, stages: int, group: dist.ProcessGroup, cluster: int, schedule: str, microbatches: int
) -> dict:
    torch.manual_seed(0)
    model = DecoderLM(get_model_config("tiny"))
    reference = copy.deepcopy(model)
    stage = PipelinedStage(model, stage_index, stages, group, microbatches, schedule)  # type: ignore[arg-type]
    params = dict(stage.module.named_parameters())
    # Each cluster its own data: a pipeline that leaked across groups would mix them up.
    (x, y), *val = _batches(seed=cluster, n=1 + EVAL_BATCHES)

    # Evaluation first, as the train loop does, so the switches eval -> train -> eval -> train are covered.
    out: dict = {"names": list(params), "eval_before": stage.evaluate(val)}
    out["grads_after_first_eval"] = [n for n, p in params.items() if p.grad is not None]
    out["loss"] = stage.forward_backward(x, y)
    out["grads"] = {n: p.grad.clone() for n, p in params.items()}
    weights = {n: p.detach().clone() for n, p in params.items()}
    out["eval_after"] = stage.evaluate(val)
    out["changed_by_eval"] = [
        n for n, p in params.items() if not (torch.equal(p, weights[n]) and torch.equal(p.grad, out["grads"][n]))
    ]
    # A second step without zeroing: gradients must accumulate as they do under loss.backward().
    out["loss_again"] = stage.forward_backward(x, y)
    out["grads_twice"] = {n: p.grad.clone() for n, p in params.items()}

    out["ref_eval"] = WholeModel(reference).evaluate(val)
    ref_loss = reference(x, y)
    ref_loss.backward()
    out["ref_loss"] = ref_loss.item()
    ref_params = dict(reference.named_parameters())
    out["ref_grads"] = {n: ref_params[n].grad.clone() for n in params}
    return out


def _all_cases(rank: int, stage_counts: list[int]) -> dict:
    world = dist.get_world_size()
    results = {}
    for stages in stage_counts:
        # Every rank must take part in creating every group, its own or not.
        cluster, stage_index = divmod(rank, stages)
        groups = [dist.new_group(_cluster_ranks(c, stages)) for c in range(world // stages)]
        for schedule, microbatches in _cases(stages):
            results[stages, schedule, microbatches] = _run_case(
                stage_index, stages, groups[cluster], cluster, schedule, microbatches
            )
    return results


def _spawn(world: int, stage_counts: list[int], out_dir: Path) -> list[dict]:
    # run_ranks' short gloo timeout turns a schedule deadlock into a failed test rather than a hung one.
    return run_ranks(_all_cases, (stage_counts,), out_dir, world)


def _check(results: list[dict], world: int, stages: int) -> None:
    all_names = [n for n, _ in DecoderLM(get_model_config("tiny")).named_parameters()]
    for schedule, microbatches in _cases(stages):
        case = f"{stages} stages, {schedule}, {microbatches} micro-batches"
        for cluster in range(world // stages):
            ranks = [results[r][stages, schedule, microbatches] for r in _cluster_ranks(cluster, stages)]
            # The stages partition the model under its original parameter names.
            assert sorted(n for out in ranks for n in out["names"]) == sorted(all_names), case
            for stage_index, out in enumerate(ranks):
                where = f"{case}, cluster {cluster}, stage {stage_index}"
                # Every stage reports the replica's loss, not only the last one.
                assert out["loss"] == pytest.approx(out["ref_loss"], abs=LOSS_TOL), where
                assert out["loss_again"] == pytest.approx(out["ref_loss"], abs=LOSS_TOL), where
                assert out["eval_before"] == pytest.approx(out["ref_eval"], abs=LOSS_TOL), where
                assert out["eval_after"] == pytest.approx(out["ref_eval"], abs=LOSS_TOL), where
                assert out["grads_after_first_eval"] == [], where
                assert out["changed_by_eval"] == [], where
                for name, ref in out["ref_grads"].items():
                    for steps, grad in ((1, out["grads"][name]), (2, out["grads_twice"][name])):
                        error = (grad - steps * ref).norm() / (steps * ref).norm()
                        assert error <= GRAD_RTOL, f"{where}, {steps} steps: {name} off by {error:.1e}"


def test_two_stages_match_the_unsplit_model(tmp_path):
    results = _spawn(2, [2], tmp_path)
    _check(results, world=2, stages=2)


def test_two_clusters_of_two_stages_and_one_of_four(tmp_path):
    results = _spawn(4, [2, 4], tmp_path)
    _check(results, world=4, stages=2)
    _check(results, world=4, stages=4)
