"""Whether a run's ranks can hold their model in this host's memory, checked before the cluster is built.

A model too large for the host is not an error the run can report: the kernel's OOM killer ends a rank (and may end
other processes on the host) and the run only learns that a rank was killed. So the estimate is made from the
model's parameter shapes (built on the meta device, no memory) before anything is created, and is a lower bound:
every rank holds its stage's weights, their gradients and AdamW's two moments in fp32, and the communication
methods keep at least one more copy (the outer model, an error-feedback buffer or momentum). Activations, the
data and the interpreter come on top, so a run the check admits can still run short; one it refuses cannot fit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

from harness.errors import UserError
from harness.units import format_bytes

# fp32 weights, gradients, AdamW's exp_avg and exp_avg_sq, and one method-side copy: 4 bytes each.
STATE_BYTES_PER_PARAMETER = 5 * 4


def available_bytes(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What new processes may still allocate: the kernel's MemAvailable, lowered to the room left under this
    cgroup's memory.max where one is set; None where neither can be read (not Linux)."""
    limits = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        maximum = (cgroup / "memory.max").read_text().strip()
        if maximum != "max":
            limits.append(int(maximum) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


# The transformers decoders whose parameters their config.json bounds from below without building them: the
# families the pipeline cuts (trainers/hf_models.py). Each has at least an embedding (vocab x hidden), and per layer
# a query and an output projection (hidden x hidden each) and an MLP of at least two matrices (hidden x its width).
_DECODER_WIDTH_KEY = {"llama": "intermediate_size", "mistral": "intermediate_size", "qwen2": "intermediate_size",
                      "qwen3": "intermediate_size", "opt": "ffn_dim"}  # fmt: skip


def parameters_at_least(model: str) -> int | None:
    """A lower bound of the parameters of the transformers decoder whose config `--model` names, read from its JSON
    alone: importing transformers and building the model on the meta device takes seconds, and a model far too
    large for the host is refused without either. None where the config is not one of those families, or unreadable
    (the full check, and validation's own messages, follow)."""
    path = Path(model).expanduser()
    file = path / "config.json" if path.is_dir() else path
    try:
        fields = json.loads(file.read_text())
        width_key = _DECODER_WIDTH_KEY[fields["model_type"]]
        hidden, layers = int(fields["hidden_size"]), int(fields["num_hidden_layers"])
        width, vocab = int(fields[width_key]), int(fields["vocab_size"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if min(hidden, layers, width, vocab) < 1:
        return None
    return vocab * hidden + layers * (2 * hidden * hidden + 2 * hidden * width)


def check_batch_fits(batch_size: int, seq_len: int, vocab_size: int, replicas: int, available: int | None) -> None:
    """Raises UserError when one step's logits alone cannot fit: each replica's last stage holds the batch's logits
    and their gradient in fp32 (2 x batch x seq_len x vocabulary x 4 bytes), a lower bound of a step's activations.
    A batch that passes can still run short, one refused cannot run."""
    needed = replicas * 2 * batch_size * seq_len * vocab_size * 4
    if available is None or needed <= available:
        return
    raise UserError(
        f"--batch-size {batch_size:,} x {seq_len:,} tokens needs at least {format_bytes(needed)} for one step's logits "
        f"and their gradient on {replicas} replica(s) ({vocab_size:,}-token vocabulary, fp32), but this host has "
        f"{format_bytes(available)} available; use a smaller --batch-size or --seq-len"
    )


def required_bytes(shapes: Iterable[tuple[int, ...]], ranks: int, stages: int) -> int:
    """The lower bound of what `ranks` ranks need together, each holding one of `stages` equal slices of the model."""
    return _required(sum(math.prod(shape) for shape in shapes), ranks, stages)


def _required(parameters: int, ranks: int, stages: int) -> int:
    return ranks * math.ceil(parameters / stages) * STATE_BYTES_PER_PARAMETER


def check_fits(shapes: Iterable[tuple[int, ...]], ranks: int, stages: int, available: int | None) -> None:
    """Raises UserError, naming the estimate and the limit, when the ranks cannot hold the model's state."""
    check_parameters_fit(sum(math.prod(shape) for shape in shapes), ranks, stages, available)


def check_parameters_fit(
    parameters: int, ranks: int, stages: int, available: int | None, at_least: bool = False
) -> None:
    """check_fits from a parameter count (`at_least`: a lower bound, parameters_at_least's)."""
    needed = _required(parameters, ranks, stages)
    if available is None or needed <= available:
        return
    raise UserError(
        f"the model has {'at least ' if at_least else ''}{parameters / 1e6:,.1f}M parameters: {ranks} rank(s) need "
        f"at least {format_bytes(needed)} "
        f"for its weights, gradients and optimizer state ({STATE_BYTES_PER_PARAMETER} bytes a parameter per rank, "
        f"split over {stages} stage(s)) but this host has {format_bytes(available)} available; use a smaller --model, "
        "fewer --clusters or more --stages"
    )
