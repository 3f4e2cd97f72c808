"""Checkpoints of a run's training state, one folder per rank, written with torch.distributed.checkpoint:

    <checkpoints>/step-<N>/rank<R>/   rank R's state after N steps (a DCP folder: .metadata and its .distcp file)
    <checkpoints>/step-<N>/complete   written by rank 0 once every rank has saved step N: only such a step resumes

A rank's state is its stage's weights, its method's `state_dict()` (optimizers, theta, error feedback, adaptation),
torch's RNG and the train loop's own record (losses so far, the last held-out loss, bytes on the wire so far). The
data position is the step: each replica's batches depend only on (seed, replica) (trainers/data.py), so skipping
N batches puts the stream where it was. Every rank saves its own state whole (no_dist): the replicas' states
differ (their local weights and inner AdamW), and nothing is sharded across ranks here. torch is imported where a
checkpoint is written or read, so the commands that only look for one (`harness cleanup`) start without it.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

COMPLETE = "complete"
_STEP_DIR = re.compile(r"step-(\d+)")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def save_rank(root: Path, step: int, rank: int, state: dict[str, Any]) -> None:
    """Rank `rank`'s state after `step` steps. Not yet resumable: `mark_complete` says when every rank has saved."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # no_dist is the point (each rank's state is its own), which DCP warns of as if it were a fallback.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=step_dir(root, step) / f"rank{rank}", no_dist=True)


def mark_complete(root: Path, step: int) -> None:
    """Step `step` is saved on every rank (the caller has waited for them): it becomes the one to resume from, and
    the checkpoints before it go (a run keeps its latest only)."""
    (step_dir(root, step) / COMPLETE).touch()
    for older in root.iterdir():
        match = _STEP_DIR.fullmatch(older.name)
        if match and int(match.group(1)) < step:
            shutil.rmtree(older, ignore_errors=True)


def latest_complete(root: Path) -> int | None:
    """The last step every rank saved under `root`, or None: a step a rank did not finish saving (the run was
    killed meanwhile) has no `complete` and is passed over."""
    if not root.is_dir():
        return None
    steps = [
        int(match.group(1))
        for entry in root.iterdir()
        if (match := _STEP_DIR.fullmatch(entry.name)) and (entry / COMPLETE).is_file()
    ]
    return max(steps, default=None)


def load_rank(root: Path, step: int, rank: int) -> dict[str, Any]:
    """What `save_rank` saved, as it was (nested dicts and lists, tensors, plain values; dict keys as strings).

    DCP loads into a state dict built beforehand with every tensor's shape; a method's lazily made state (error
    feedback appears with the first exchange) has none before it is loaded, so the checkpoint is read whole, as
    DCP's own format converter reads it."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="harness-checkpoint-") as scratch:
        whole = Path(scratch) / "state.pt"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_to_torch_save(step_dir(root, step) / f"rank{rank}", whole)
        # The file was written just now from this run's own checkpoint: its Python values (deques, None) are ours.
        return torch.load(whole, weights_only=False)
