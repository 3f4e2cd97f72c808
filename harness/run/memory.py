"""Whether a run's ranks can hold their model in this host's memory, checked before the cluster is built.

A model too large for the host is not an error the run can report: the kernel's OOM killer ends a rank (and may end
other processes on the host) and the run only learns that a rank was killed. So the estimate is made from the
model's parameter shapes (built on the meta device, no memory) before anything is created, and is a lower bound:
every rank holds its stage's weights, their gradients and AdamW's two moments in fp32, and the communication
methods keep at least one more copy (the outer model, an error-feedback buffer or momentum). Activations, the
data and the interpreter come on top, so a run the check admits can still run short; one it refuses cannot fit.
"""

from __future__ import annotations

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


def required_bytes(shapes: Iterable[tuple[int, ...]], ranks: int, stages: int) -> int:
    """The lower bound of what `ranks` ranks need together, each holding one of `stages` equal slices of the model."""
    parameters = sum(math.prod(shape) for shape in shapes)
    return ranks * math.ceil(parameters / stages) * STATE_BYTES_PER_PARAMETER


def check_fits(shapes: Iterable[tuple[int, ...]], ranks: int, stages: int, available: int | None) -> None:
    """Raises UserError, naming the estimate and the limit, when the ranks cannot hold the model's state."""
    shapes = list(shapes)
    needed = required_bytes(shapes, ranks, stages)
    if available is None or needed <= available:
        return
    parameters = sum(math.prod(shape) for shape in shapes)
    raise UserError(
        f"the model has {parameters / 1e6:,.1f}M parameters: {ranks} rank(s) need at least {format_bytes(needed)} "
        f"for its weights, gradients and optimizer state ({STATE_BYTES_PER_PARAMETER} bytes a parameter per rank, "
        f"split over {stages} stage(s)) but this host has {format_bytes(available)} available; use a smaller --model, "
        "fewer --clusters or more --stages"
    )
