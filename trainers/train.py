"""The train loop: the same for every method. Forward and backward here; synchronization in the method.

Every step logs an event; evaluation runs on the method's synchronized parameters at fixed step counts, so every
method is evaluated at the same token counts on the same held-out batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainers.config import TrainConfig
from trainers.data import data_phase, load_corpus, replica_batches, validation_batches
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
    batches: Any
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
    # One batch per step, so the stream counts steps: with data_shift it moves to another segment every N batches.
    batches = replica_batches(
        corpus, par.cluster, par.clusters, cfg.batch_size, seq_len, cfg.seed, data_shift=cfg.data_shift
    )
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
    return _Setup(stage, method, batches, val_batches, tokens_per_step, corpus.bits_per_byte)


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


def train(
    cfg: TrainConfig,
    method_name: str,
    method_config: Any,
    par: ParallelContext,
    log: EventLog,
    read_wire_bytes: Callable[[], int] | None = None,
) -> dict[str, Any]:
    """Train one rank's part of one replica; returns this rank's end-of-run figures."""
    setup = _set_up(cfg, method_name, method_config, par, log)
    stage, method, tokens_per_step = setup.stage, setup.method, setup.tokens_per_step
    evaluate = _Evaluator(setup, log)
    evaluate(0)
    dist.barrier()
    wire_start = read_wire_bytes() if read_wire_bytes else None
    window_start = time.perf_counter()
    eval_s_at_window_start = evaluate.total_s
    losses = []
    for step in range(cfg.steps):
        started = time.perf_counter()
        inputs, targets = (t.to(par.device, non_blocking=True) for t in next(setup.batches))
        loss = stage.forward_backward(inputs, targets)
        computed = time.perf_counter()
        report = method.step(step)
        # Communication still in flight after the last step belongs to the run: drain it inside the window.
        final_reports = method.finish() if step == cfg.steps - 1 else []
        ended = time.perf_counter()
        losses.append(loss)
        event = {
            "kind": "step",
            "step": step,
            "tokens": (step + 1) * tokens_per_step,
            "loss": loss,
            "lr": method.lr,
            "compute_s": computed - started,
            "step_s": ended - started,
        }
        if cfg.data_shift:
            event["data_phase"] = data_phase(step, cfg.data_shift)
        if report is not None:
            event.update(_sync_fields(report))
        if read_wire_bytes:
            event["wire_bytes"] = read_wire_bytes() - wire_start
        log(event)
        for final_report in final_reports:
            log({"kind": "finish", "step": step, **_sync_fields(final_report)})
        if step + 1 == cfg.throughput_warmup_steps:
            window_start = ended
            eval_s_at_window_start = evaluate.total_s
        if (step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1:
            evaluate(step + 1)
    window_end = time.perf_counter()
    dist.barrier()
    wire_bytes = read_wire_bytes() - wire_start if read_wire_bytes else None
    window_s = window_end - window_start - (evaluate.total_s - eval_s_at_window_start)
    result = _result(cfg, method, losses, evaluate.val_loss, window_s, tokens_per_step, wire_bytes)
    result["final_val_bpb"] = setup.bits_per_byte(evaluate.val_loss)
    log({"kind": "end", **result})
    return result


def _result(
    cfg: TrainConfig,
    method: Any,
    losses: list[float],
    val_loss: float | None,
    window_s: float,
    tokens_per_step: int,
    wire_bytes: int | None,
) -> dict[str, Any]:
    """This rank's end-of-run figures."""
    window_steps = cfg.steps - cfg.throughput_warmup_steps
    tail = losses[-min(10, len(losses)) :]
    # Applied steps are a prefix of the run: those of the window are the ones after its warm-up steps.
    applied_steps = method.applied_steps(cfg.steps)
    return {
        "final_train_loss": sum(tail) / len(tail),
        "final_val_loss": val_loss,
        "window_steps": window_steps,
        "window_tokens": window_steps * tokens_per_step,
        "window_applied_tokens": max(0, applied_steps - cfg.throughput_warmup_steps) * tokens_per_step,
        "window_s": window_s,
        "tokens": cfg.steps * tokens_per_step,
        "applied_tokens": applied_steps * tokens_per_step,
        "optimizer_state_bytes": method.optimizer_state_bytes(),
        "wire_bytes": wire_bytes,
    }
