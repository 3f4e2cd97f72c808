"""A run's scalars as TensorBoard event files, from the events its ranks write (harness/run/events.py).

One path for both uses: `harness run --tensorboard` feeds each event to `RunScalars` as the runner reads it, so
TensorBoard shows the run while it trains (`tensorboard --logdir <run folder>/tensorboard`); `harness report
--tensorboard DIR` feeds a finished run's event files to it afterwards, one subfolder per run, so a sweep's runs lie
side by side. The x axis is the training step, the wall time each event's own, so TensorBoard's relative and wall
axes show real time too.

    train/loss            mean over clusters of the last pipeline stage's loss (written once every cluster logged it)
    train/lr              the inner learning rate
    train/tokens_per_s    tokens applied per step (every cluster's) over rank 0's step time
    val/loss              held-out loss per token, at every evaluation
    val/bits_per_byte     the same in bits per byte of text, comparable across tokenizers
    link/wire_bytes       bytes cluster 0's uplink sent since training started (the kernel's counter)
    link/send_bps         those bytes' rate over the step
    link/utilization      that rate over the profile's inter-cluster rate
    sync/<field>          every number an exchange reports (payload_bytes, blocked_s, overlapped_s, rank_r, ...)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.errors import UserError
from harness.run.events import EventTail
from harness.run.folder import RunPaths, read_config, read_events, read_summary

INSTALL_HINT = "pip install -e '.[tensorboard]' (make setup installs it)"


def check_available() -> None:
    """Raises UserError when torch's TensorBoard writer cannot be imported (the tensorboard package is missing)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise UserError(f"--tensorboard needs the tensorboard package; install it with {INSTALL_HINT}") from None


class RunScalars:
    """Writes one run's scalars into `log_dir` as its events are added, in any order across ranks; `writer`, any
    object with TensorBoard's add_scalar and close, writes them elsewhere instead (W&B: weights_and_biases.py)."""

    def __init__(self, log_dir: Path | None, config: dict[str, Any], writer: Any = None):
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(log_dir))
        self.clusters, self.stages = config["clusters"], config["stages"]
        self.rate_bps = config["profile"]["inter_cluster"].get("rate_bps")
        self.writer = writer
        # step -> {cluster: loss}, until every cluster has logged that step
        self._losses: dict[int, dict[int, float]] = {}
        self._last_wire_bytes = 0
        self._tokens_per_step: int | None = None

    def add(self, rank: int, event: dict[str, Any]) -> None:
        kind, t = event.get("kind"), event.get("t")
        cluster, stage = divmod(rank, self.stages)
        if kind == "step" and stage == self.stages - 1:
            self._add_loss(event["step"], cluster, event["loss"], t)
        if kind == "eval" and rank == self.stages - 1:
            self._scalar("val/loss", event["val_loss"], event["step"], t)
            self._scalar("val/bits_per_byte", event.get("val_bpb"), event["step"], t)
        if rank != 0:
            return
        if kind == "start":
            self._tokens_per_step = event["tokens_per_step"]
        if kind not in ("step", "finish"):
            return
        step = event["step"]
        for name, value in event.items():
            if name.startswith("sync_"):
                self._scalar(f"sync/{name.removeprefix('sync_')}", value, step, t)
        if kind == "step":
            self._add_step(event, t)

    def _add_step(self, event: dict[str, Any], t: float | None) -> None:
        step, step_s = event["step"], event["step_s"]
        self._scalar("train/lr", event["lr"], step, t)
        if step_s > 0 and self._tokens_per_step:
            self._scalar("train/tokens_per_s", self._tokens_per_step / step_s, step, t)
        if "wire_bytes" in event:
            wire_bytes = event["wire_bytes"]
            self._scalar("link/wire_bytes", wire_bytes, step, t)
            if step_s > 0:
                send_bps = (wire_bytes - self._last_wire_bytes) * 8 / step_s
                self._scalar("link/send_bps", send_bps, step, t)
                if self.rate_bps:
                    self._scalar("link/utilization", send_bps / self.rate_bps, step, t)
            self._last_wire_bytes = wire_bytes

    def _add_loss(self, step: int, cluster: int, loss: float, t: float | None) -> None:
        losses = self._losses.setdefault(step, {})
        losses[cluster] = loss
        if len(losses) == self.clusters:
            self._scalar("train/loss", sum(losses.values()) / self.clusters, step, t)
            del self._losses[step]

    def _scalar(self, tag: str, value: Any, step: int, t: float | None) -> None:
        # Booleans and None (a field an exchange does not have this round) are not scalars.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self.writer.add_scalar(tag, value, global_step=step, walltime=t)

    def close(self) -> None:
        self.writer.close()


class LiveScalars:
    """`RunScalars` (one per destination: TensorBoard, W&B) fed from the event files of a run in progress: `poll`
    between the runner's checks, `close` once the ranks have stopped (it reads what they wrote last first)."""

    def __init__(self, run_dir: Path, scalars: list[RunScalars], config: dict[str, Any]):
        paths = RunPaths(run_dir)
        world = config["clusters"] * config["stages"]
        self.tails = {rank: EventTail(paths.events(rank)) for rank in range(world)}
        self.scalars = scalars

    def poll(self) -> None:
        for rank, tail in self.tails.items():
            for event in tail:
                for scalars in self.scalars:
                    scalars.add(rank, event)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Reads the last events, hands `summary` to a writer that keeps one (W&B), and closes every writer."""
        try:
            self.poll()
            for scalars in self.scalars:
                if summary is not None and hasattr(scalars.writer, "set_summary"):
                    scalars.writer.set_summary(summary)
        finally:
            for scalars in self.scalars:
                scalars.close()


def write_run(run_dir: Path, log_dir: Path | None, writer: Any = None) -> Path | None:
    """A finished run folder's scalars into `log_dir` (or `writer`, with the run's summary); returns `log_dir`."""
    scalars = RunScalars(log_dir, read_config(run_dir), writer)
    try:
        for rank in RunPaths(run_dir).event_ranks():
            for event in read_events(run_dir, rank):
                scalars.add(rank, event)
        if hasattr(scalars.writer, "set_summary"):
            scalars.writer.set_summary(read_summary(run_dir))
    finally:
        scalars.close()
    return log_dir


def check_log_dir(out: Path) -> None:
    """`harness report --tensorboard OUT` can write there; raises UserError. Event files are appended, never
    replaced, so a folder that already holds some would show every run twice."""
    check_available()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--tensorboard {out} already exists and is not an empty folder; pass a new folder")


def write_runs(runs: list[tuple[Path, str]], out: Path) -> Path:
    """Every run (folder, label: harness/run/folder.py's find_run_dirs) into `out`/<label>, side by side; returns
    `out`."""
    check_log_dir(out)
    for run_dir, label in runs:
        write_run(run_dir, out / label)
    return out
