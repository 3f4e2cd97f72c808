"""The training side's configuration: what every method shares. One place where these defaults live.

Method-specific settings live next to the method (each method file defines its own config dataclass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class OptimConfig:
    """The inner optimizer every method uses: AdamW with linear warm-up then cosine decay."""

    lr: float = 4e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    # Warm-up length as a share of the run, so short CI runs and long benchmarks get the same schedule shape.
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0

    def validate(self) -> None:
        """Finite numbers in range (nan passes no comparison, so every check is written to fail on it)."""
        if not (_real(self.lr) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be a positive finite number, got {self.lr}")
        if not (_real(self.weight_decay) and math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number of at least 0, got {self.weight_decay}")
        betas = tuple(self.betas) if isinstance(self.betas, (tuple, list)) else ()
        if len(betas) != 2 or not all(_real(b) and 0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        for name, value in (("warmup_fraction", self.warmup_fraction), ("min_lr_ratio", self.min_lr_ratio)):
            if not (_real(value) and 0 <= value <= 1):
                raise ValueError(f"{name} must be a number in [0, 1], got {value}")
        if not (_real(self.grad_clip) and math.isfinite(self.grad_clip) and self.grad_clip > 0):
            raise ValueError(f"grad_clip must be a positive finite number, got {self.grad_clip}")


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TrainConfig:
    """What is trained, on what, for how long. Identical for every method in a comparison."""

    model: str = "tiny"
    steps: int = 200
    # Sequences per replica per step; the global batch is clusters x batch_size sequences.
    batch_size: int = 8
    # 0 means the model's max_seq_len.
    seq_len: int = 0
    seed: int = 0
    # Pipeline micro-batches per step when stages > 1 (must be >= stages to keep every stage busy).
    microbatches: int = 0
    # torch.distributed.pipelining schedule when stages > 1: "1f1b" holds fewer activations than "gpipe".
    pipeline_schedule: str = "1f1b"
    eval_every: int = 50
    eval_batches: int = 8
    # Steps excluded from throughput: the first steps pay for allocator warm-up and connection set-up.
    throughput_warmup_steps: int = 5
    data: str | None = None
    # The field that holds a record's text in JSONL, parquet or saved-dataset --data (trainers/documents.py).
    data_field: str = "text"
    # bytes, a local tokenizer.json, or bpe:N trained on the corpus (trainers/tokenizer.py). A built-in model's
    # vocabulary follows it; a transformers config keeps its own, which must hold it.
    tokenizer: str = "bytes"
    # Every data_shift steps each replica's batches move to another of SHIFT_SEGMENTS (8) contiguous segments of its
    # shard, all replicas at the same steps (trainers/data.py, replica_batches); 0 = off. Validation does not shift.
    data_shift: int = 0
    # torch threads per rank; 0 = the machine's cores over its ranks (more only adds contention). The CI gate sets
    # 1, so that a step's parts are timed alike on a machine with more cores (harness/analysis/gate/check.py).
    threads_per_rank: int = 0
    optim: OptimConfig = field(default_factory=OptimConfig)

    def model_config(self) -> Any:
        """The model this trains (trainers.models): a built-in one takes the tokenizer's vocabulary, except under
        `bytes`, where it keeps its own so the published shapes (opt-125m, qwen1.5-107b) stay exact; a transformers
        config keeps its vocabulary, which must hold the tokenizer's ids."""
        # Imported here: this module stays free of torch and transformers for the commands that only read configs.
        from trainers.models import ModelConfig, get_model_config, with_vocab
        from trainers.tokenizer import BYTES, declared_vocab_size, parse_tokenizer

        model = get_model_config(self.model)
        if self.tokenizer == BYTES and isinstance(model, ModelConfig):
            return model
        return with_vocab(model, declared_vocab_size(parse_tokenizer(self.tokenizer)))

    def validate(self) -> None:
        self.optim.validate()
        if not (isinstance(self.data_field, str) and self.data_field):
            raise ValueError(f"--data-field must name a field, got {self.data_field!r}")
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.seq_len < 0:
            raise ValueError(f"--seq-len must be positive, got {self.seq_len}")
        if self.eval_every < 1:
            raise ValueError(f"--eval-every must be at least 1, got {self.eval_every}")
        if self.eval_batches < 1:
            raise ValueError(f"eval_batches must be at least 1, got {self.eval_batches}")
        # numpy's SeedSequence takes no negative seed, torch's manual_seed none above 64 bits.
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"--seed must be in [0, 2**64), got {self.seed}")
        if self.microbatches < 0:
            raise ValueError(f"--microbatches must be at least 0 (0: one per stage), got {self.microbatches}")
        if self.pipeline_schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"--pipeline-schedule must be 1f1b or gpipe, got {self.pipeline_schedule!r}")
        # Whether each segment holds a window depends on the corpus: check_data and replica_batches check that.
        if not (_int(self.data_shift) and self.data_shift >= 0):
            raise ValueError(f"--data-shift must be 0 (off) or a positive number of steps, got {self.data_shift}")
        if not (_int(self.threads_per_rank) and self.threads_per_rank >= 0):
            raise ValueError(f"threads_per_rank must be 0 (cores over ranks) or more, got {self.threads_per_rank}")
        if not 0 <= self.throughput_warmup_steps < self.steps:
            raise ValueError(f"--throughput-warmup-steps must be in [0, steps), got {self.throughput_warmup_steps}")


def format_value(value: Any) -> str:
    """The text --set reads back as `value`: true/false, none."""
    if isinstance(value, bool):
        return str(value).lower()
    return "none" if value is None else str(value)
