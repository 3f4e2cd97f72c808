"""The train loop: the same for every method. Forward and backward here; synchronization in the method.

Every step logs an event; evaluation runs on the method's synchronized parameters at fixed step counts, so every
method is evaluated at the same token counts on the same held-out batches.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainers.checkpoint import latest_complete, load_rank, mark_complete, save_rank
from trainers.config import TrainConfig
from trainers.data import data_phase, load_corpus, replica_batches, validation_batches
from trainers.fault_tolerance import ManagedGroup
from trainers.method import MethodContext
from trainers.models import build_model, count_parameters
from trainers.pipeline import build_stage
from trainers.registry import build_method

EventLog = Callable[[dict[str, Any]], None]


@dataclass
class ParallelContext:
    """Where this rank sits: cluster (replica) and pipeline stage, and the groups it talks in."""

    rank: int
    cluster: int
    clusters: int
    stage: int
    stages: int
    pipeline_group: dist.ProcessGroup | None
    data_parallel_group: dist.ProcessGroup | None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass
class _Setup:
    """What one rank trains: its stage of the model, its method, its data."""

    stage: Any
    method: Any
    batches_from: Callable[[int], Iterator[tuple[torch.Tensor, torch.Tensor]]]  # the stream from a step on
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]  # the stream the next step draws from
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    tokens_per_step: int
    bits_per_byte: Callable[[float], float]  # a held-out loss per token in bits per byte of text


def _set_up(cfg: TrainConfig, method_name: str, method_config: Any, par: ParallelContext, log: EventLog) -> _Setup:
    corpus = load_corpus(cfg.data, tokenizer=cfg.tokenizer, text_field=cfg.data_field)
    model_cfg = cfg.model_config()
    seq_len = cfg.seq_len or model_cfg.max_seq_len
    # The same seed on every rank gives every replica identical initial weights without a broadcast.
    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg).to(par.device)
    stage = build_stage(
        model, par.stage, par.stages, par.pipeline_group, cfg.microbatches or par.stages, cfg.pipeline_schedule
    )

    def batches_from(step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # One batch per step, so the stream counts steps: with data_shift it moves to another segment every N
        # batches. The stream is a function of (seed, replica): from step N it is the batches of steps N, N + 1, ...
        stream = replica_batches(
            corpus, par.cluster, par.clusters, cfg.batch_size, seq_len, cfg.seed, data_shift=cfg.data_shift
        )
        next(itertools.islice(stream, step, step), None)
        return stream

    val_batches = [
        (x.to(par.device), y.to(par.device))
        for x, y in validation_batches(corpus, cfg.batch_size, seq_len, cfg.eval_batches)
    ]
    ctx = MethodContext(
        list(stage.module.named_parameters()),
        par.data_parallel_group,
        par.pipeline_group,
        cfg.optim,
        cfg.steps,
        cfg.seed,
    )
    method = build_method(method_name, method_config, ctx)
    tokens_per_step = par.clusters * cfg.batch_size * seq_len
    log(
        {
            "kind": "start",
            "param_count": count_parameters(model_cfg),
            "stage_param_count": sum(p.numel() for p in ctx.params),
            "seq_len": seq_len,
            "tokens_per_step": tokens_per_step,
            "corpus": corpus.source,
            "corpus_sha256": corpus.sha256,
            "tokenizer": corpus.tokenizer,
            "tokenizer_sha256": corpus.tokenizer_sha256,
            "vocab_size": corpus.vocab_size,
            "val_tokens_per_byte": corpus.val_tokens_per_byte,
            "device": str(par.device),
        }
    )
    return _Setup(stage, method, batches_from, batches_from(0), val_batches, tokens_per_step, corpus.bits_per_byte)


class _Evaluator:
    """Validation on the method's synchronized parameters; keeps its total time, which tokens/s leaves out."""

    def __init__(self, setup: _Setup, log: EventLog):
        self.setup, self.log = setup, log
        self.total_s = 0.0
        self.val_loss: float | None = None

    def __call__(self, step: int) -> None:
        started = time.perf_counter()
        with self.setup.method.eval_parameters():
            self.val_loss = self.setup.stage.evaluate(self.setup.val_batches)
        eval_s = time.perf_counter() - started
        self.total_s += eval_s
        self.log(
            {
                "kind": "eval",
                "step": step,
                "tokens": step * self.setup.tokens_per_step,
                "val_loss": self.val_loss,
                "val_bpb": self.setup.bits_per_byte(self.val_loss),
                "eval_s": eval_s,
                "val_tokens": sum(y.numel() for _, y in self.setup.val_batches),
            }
        )


def _sync_fields(report: Any) -> dict[str, Any]:
    return {f"sync_{k}": v for k, v in report.as_event().items()}


@dataclass(frozen=True)
class Checkpointing:
    """Where a run's checkpoints lie (trainers/checkpoint.py) and how often to write them; a run whose folder holds
    a complete one resumes from it."""

    directory: Path
    every_steps: int = 0  # 0: never write one (a run may still resume from one written before)


@dataclass
class _Progress:
    """The train loop's record of the run so far: what a checkpoint carries besides the method's state."""

    start_step: int = 0
    losses: list[float] = field(default_factory=list)
    wire_bytes: int = 0  # bytes this rank's uplink carried in the steps before start_step


def train(
    cfg: TrainConfig,
    method_name: str,
    method_config: Any,
    par: ParallelContext,
    log: EventLog,
    read_wire_bytes: Callable[[], int] | None = None,
    checkpointing: Checkpointing | None = None,
) -> dict[str, Any]:
    """Train one rank's part of one replica, from the run's latest checkpoint if it has one; returns this rank's
    end-of-run figures (those of time, of the steps since it started or resumed)."""
    setup = _set_up(cfg, method_name, method_config, par, log)
    stage, method, tokens_per_step = setup.stage, setup.method, setup.tokens_per_step
    evaluate = _Evaluator(setup, log)
    progress = _resume(setup, evaluate, par, checkpointing, log)
    group = par.data_parallel_group
    rounds = _Rounds(group, setup, log) if isinstance(group, ManagedGroup) else None
    if progress.start_step == 0 and not (rounds and group.rejoining):
        evaluate(0)
    saver = _Saver(setup, evaluate, par, checkpointing, progress.start_step, log)
    dist.barrier()
    # Counted on from where the checkpoint left it, so a step's wire_bytes means the same in a resumed run.
    wire_start = read_wire_bytes() - progress.wire_bytes if read_wire_bytes else None
    # A resumed run's throughput window is its own: the steps since it resumed, after their own warm-up.
    window_first_step = progress.start_step + min(cfg.throughput_warmup_steps, cfg.steps - progress.start_step - 1)
    window_start = time.perf_counter()
    excluded_s_at_window_start = evaluate.total_s
    losses, step = progress.losses, progress.start_step
    while step < cfg.steps:
        if rounds is not None and rounds.starting:
            step = rounds.begin(step, losses)
        started = time.perf_counter()
        inputs, targets = (t.to(par.device, non_blocking=True) for t in next(setup.batches))
        loss = stage.forward_backward(inputs, targets)
        computed = time.perf_counter()
        report = method.step(step)
        # Communication still in flight after the last step belongs to the run: drain it inside the window.
        final_reports = method.finish() if step == cfg.steps - 1 else []
        ended = time.perf_counter()
        if rounds is not None and (report is not None or final_reports) and not rounds.commit(step, losses):
            step = rounds.snapshot["step"]
            continue
        losses.append(loss)
        event = _step_event(cfg, method, step, loss, tokens_per_step, computed - started, ended - started, report)
        if read_wire_bytes:
            event["wire_bytes"] = read_wire_bytes() - wire_start
        log(event)
        for final_report in final_reports:
            log({"kind": "finish", "step": step, **_sync_fields(final_report)})
        if step + 1 == window_first_step:
            window_start = ended
            excluded_s_at_window_start = evaluate.total_s + saver.total_s
        if (step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1:
            evaluate(step + 1)
        if step + 1 < cfg.steps:
            saver.maybe_save(step + 1, losses, lambda: read_wire_bytes() - wire_start if read_wire_bytes else 0)
        step += 1
    window_end = time.perf_counter()
    dist.barrier()
    wire_bytes = read_wire_bytes() - wire_start if read_wire_bytes else None
    window_s = window_end - window_start - (evaluate.total_s + saver.total_s - excluded_s_at_window_start)
    result = _result(cfg, method, losses, evaluate.val_loss, window_s, tokens_per_step, wire_bytes, window_first_step)
    result["final_val_bpb"] = setup.bits_per_byte(evaluate.val_loss)
    if progress.start_step:
        result["resumed_at_step"] = progress.start_step
    log({"kind": "end", **result})
    return result


def _step_event(
    cfg: TrainConfig,
    method: Any,
    step: int,
    loss: float,
    tokens_per_step: int,
    compute_s: float,
    step_s: float,
    report: Any,
) -> dict[str, Any]:
    event = {
        "kind": "step",
        "step": step,
        "tokens": (step + 1) * tokens_per_step,
        "loss": loss,
        "lr": method.lr,
        "compute_s": compute_s,
        "step_s": step_s,
    }
    if cfg.data_shift:
        event["data_phase"] = data_phase(step, cfg.data_shift)
    if report is not None:
        event.update(_sync_fields(report))
    return event


class NothingToRejoin(Exception):
    """A restarted replica whose first quorum had no peer to heal from: the run ended while it was down."""


class _Rounds:
    """The train loop's side of fault tolerance (trainers/fault_tolerance.py): a round starts after every exchange
    (every step for AllReduce, every H steps for a DiLoCo round), with a quorum from a snapshot of this rank's
    state; a heal puts the rank at its peer's round; a round whose exchange did not commit (a replica failed in it)
    is trained again from the snapshot, its events left in the log and a `discarded` event saying which steps.

    The snapshot is what a rejoining peer fetches, so it is a copy: the cost of fault tolerance here is one copy of
    the model and the method's state per round, besides the quorum's round trip to the lighthouse.
    """

    def __init__(self, group: ManagedGroup, setup: _Setup, log: EventLog):
        self.group, self.setup, self.log = group, setup, log
        self.starting = True
        self.snapshot: dict[str, Any] = {}
        self._losses_kept = 0

    def _load(self, state: dict[str, Any]) -> None:
        # A copy: torch's Optimizer.load_state_dict keeps the tensors it is given and every step updates them in
        # place, so loading `state` itself would let the round change the snapshot it may have to go back to (a
        # healed rank's snapshot is the state it received; a discard then restored the discarded steps' moments).
        state = copy.deepcopy(state)
        self.setup.stage.module.load_state_dict(state["model"])
        self.setup.method.load_state_dict(state["method"])
        self.setup.batches = self.setup.batches_from(state["step"])

    def begin(self, step: int, losses: list[float]) -> int:
        """Start the round at `step`; the step to train (a peer's, after a heal)."""
        self.snapshot = copy.deepcopy(
            {"step": step, "model": self.setup.stage.module.state_dict(), "method": self.setup.method.state_dict()}
        )
        self._losses_kept = len(losses)
        self.starting = False
        healed = self.group.quorum(self.snapshot, self._load)
        if healed is None and self.group.rejoining and step == 0:
            raise NothingToRejoin(
                "restarted after a failure, this replica found no live peer ahead of it to heal from: the others had "
                "finished"
            )
        if healed is None:
            return step
        self.snapshot = healed
        return healed["step"]

    def commit(self, step: int, losses: list[float]) -> bool:
        """Whether the round that ends with `step` stands; if not, the rank is back at its start."""
        self.starting = True
        if self.group.commit():
            self.log(
                {
                    "kind": "commit",
                    "from_step": self.snapshot["step"],
                    "to_step": step + 1,
                    "participants": self.group.size(),
                }
            )
            return True
        self._load(self.snapshot)
        del losses[self._losses_kept :]
        self.log({"kind": "discarded", "from_step": self.snapshot["step"], "to_step": step + 1})
        return False


def _resume(
    setup: _Setup, evaluate: _Evaluator, par: ParallelContext, checkpointing: Checkpointing | None, log: EventLog
) -> _Progress:
    """Load the run's latest complete checkpoint into the freshly built stage and method, if there is one."""
    step = latest_complete(checkpointing.directory) if checkpointing else None
    if step is None:
        return _Progress()
    state = load_rank(checkpointing.directory, step, par.rank)
    setup.stage.module.load_state_dict(state["model"])
    setup.method.load_state_dict(state["method"])
    torch.set_rng_state(state["rng"])
    setup.batches = setup.batches_from(step)
    evaluate.val_loss = state["val_loss"]
    log({"kind": "resume", "step": step})
    return _Progress(step, list(state["losses"]), state["wire_bytes"])


class _Saver:
    """Writes a checkpoint every `every_steps` steps, at the first step from then on where the method has nothing
    in flight (the same step on every rank), and keeps its time, which tokens/s leaves out as it does evaluation."""

    def __init__(
        self,
        setup: _Setup,
        evaluate: _Evaluator,
        par: ParallelContext,
        checkpointing: Checkpointing | None,
        start_step: int,
        log: EventLog,
    ):
        self.setup, self.evaluate, self.par, self.log = setup, evaluate, par, log
        self.directory = checkpointing.directory if checkpointing else None
        self.every_steps = checkpointing.every_steps if checkpointing else 0
        self.last_step = start_step
        self.total_s = 0.0

    def maybe_save(self, steps_done: int, losses: list[float], wire_bytes: Callable[[], int]) -> None:
        """`wire_bytes`: this rank's uplink bytes so far, read only when a checkpoint is taken (a read costs)."""
        due = self.every_steps and steps_done - self.last_step >= self.every_steps
        if not due or not self.setup.method.checkpointable():
            return
        started = time.perf_counter()
        state = {
            "model": self.setup.stage.module.state_dict(),
            "method": self.setup.method.state_dict(),
            "rng": torch.get_rng_state(),
            "losses": losses,
            "val_loss": self.evaluate.val_loss,
            "wire_bytes": wire_bytes(),
        }
        save_rank(self.directory, steps_done, self.par.rank, state)
        dist.barrier()
        if self.par.rank == 0:
            mark_complete(self.directory, steps_done)
        self.last_step = steps_done
        save_s = time.perf_counter() - started
        self.total_s += save_s
        self.log({"kind": "checkpoint", "step": steps_done, "save_s": save_s})


def _result(
    cfg: TrainConfig,
    method: Any,
    losses: list[float],
    val_loss: float | None,
    window_s: float,
    tokens_per_step: int,
    wire_bytes: int | None,
    window_first_step: int,
) -> dict[str, Any]:
    """This rank's end-of-run figures."""
    window_steps = cfg.steps - window_first_step
    tail = losses[-min(10, len(losses)) :]
    # Applied steps are a prefix of the run: those of the window are the ones after its warm-up steps.
    applied_steps = method.applied_steps(cfg.steps)
    return {
        "final_train_loss": sum(tail) / len(tail),
        "final_val_loss": val_loss,
        "window_steps": window_steps,
        "window_tokens": window_steps * tokens_per_step,
        "window_applied_tokens": max(0, applied_steps - window_first_step) * tokens_per_step,
        "window_s": window_s,
        "tokens": cfg.steps * tokens_per_step,
        "applied_tokens": applied_steps * tokens_per_step,
        "optimizer_state_bytes": method.optimizer_state_bytes(),
        "wire_bytes": wire_bytes,
    }
