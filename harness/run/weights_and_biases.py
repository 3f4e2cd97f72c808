"""A run's scalars, config and summary in Weights & Biases: the same scalars TensorBoard gets, by the same names.

`harness run --wandb` logs a run while it trains (its W&B files in the run folder's wandb/); `harness report --wandb`
logs finished runs afterwards, one W&B run each, named by its label. Where the runs go is W&B's own settings:
WANDB_PROJECT (default "harness"), WANDB_ENTITY, and WANDB_MODE=offline to write them for a later `wandb sync`
with no network (what the tests do). The x axis is the training step (the scalar `step`), so the events of several
ranks may arrive in any order.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness.errors import UserError

INSTALL_HINT = "pip install -e '.[wandb]'"
DEFAULT_PROJECT = "harness"
STEP = "step"


def check_available() -> None:
    """Raises UserError when the wandb package cannot be imported."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserError(f"--wandb needs the wandb package; install it with {INSTALL_HINT}") from None


class WandbWriter:
    """One W&B run, written through the interface RunScalars writes TensorBoard's with (add_scalar, close).

    Args:
        name: the run's name in W&B (a run id, or a report's label for the run).
        config: the run's config.json, logged as the W&B run's config.
        files_dir: where W&B keeps the run's files (its `wandb/` folder goes there).
    """

    def __init__(self, name: str, config: dict[str, Any], files_dir: Path):
        import wandb

        files_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
            name=name,
            config=config,
            dir=str(files_dir),
            reinit="create_new",
        )
        # Every scalar against the training step, not W&B's own call counter: ranks' events interleave.
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)

    def add_scalar(self, tag: str, value: float, global_step: int, walltime: float | None = None) -> None:
        self.run.log({tag: value, STEP: global_step})

    def set_summary(self, summary: dict[str, Any]) -> None:
        """The run's summary.json figures (numbers only) as the W&B run's summary."""
        self.run.summary.update(
            {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        )

    def close(self) -> None:
        import wandb

        self.run.finish()
        # W&B's service process outlives finish(): a run leaves no process behind.
        wandb.teardown()


def files_of(run_dir: Path) -> Path:
    """Where `harness run --wandb` keeps a run's W&B files: in its folder."""
    return run_dir / "wandb"


def log_runs(runs: list[tuple[Path, str]]) -> str:
    """Every finished run (folder, label) as its own W&B run named by its label; returns where they went. W&B's
    files go where WANDB_DIR says, else under the current folder (wandb/)."""
    from harness.run.folder import read_config
    from harness.run.tensorboard import write_run

    files_dir = Path(os.environ.get("WANDB_DIR") or ".")
    for run_dir, label in runs:
        write_run(run_dir, None, WandbWriter(label, read_config(run_dir), files_dir))
    mode = os.environ.get("WANDB_MODE", "online")
    return f"{len(runs)} run(s) to W&B project {os.environ.get('WANDB_PROJECT', DEFAULT_PROJECT)} ({mode})"
