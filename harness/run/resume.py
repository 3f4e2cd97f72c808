"""`harness run --resume RUN_DIR`: continue an interrupted run in its own folder from its latest checkpoint.

A run saved with checkpoint_every that then failed (a killed rank, Ctrl-C, a lost link) or whose harness was
killed (its staging folder left behind) continues from the last step every rank saved (trainers/checkpoint.py):
same config, same folder, the steps after that checkpoint trained again. Its events are rewound to the checkpoint
first, so the folder reads as one run; the summary says where it resumed (`resumed_at_steps`). What differs from
an uninterrupted run: wall-clock times (`wall_s`, event times) include the time it was down; tokens/s is measured
over the steps since the last resume (after their own warm-up); `wire_bytes_run` counts the last part only, while
the ranks' wire_bytes count every step in the record (the bytes of steps trained twice, once).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from harness.errors import UserError
from harness.run.config import RunConfig, new_run_key
from harness.run.folder import ResultsError, RunFolder, RunPaths, read_summary


def _rewound(event: dict[str, Any], step: int) -> bool:
    """Whether `event` belongs to the run up to checkpoint `step`: the steps before it and what was measured after
    them (evaluation at `step`, the checkpoint itself); the end, errors and anything later go."""
    kind = event.get("kind")
    if kind in ("end", "error"):
        return False
    if kind in ("step", "finish"):
        return event["step"] < step
    if "step" in event:
        return event["step"] <= step
    return True


def rewind_events(paths: RunPaths, step: int) -> None:
    """Each rank's events as they were when checkpoint `step` was written (a line cut short by a kill goes too)."""
    for rank in paths.event_ranks():
        path = paths.events(rank)
        kept = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and _rewound(event, step):
                kept.append(line)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, path)


def previous_record(paths: RunPaths) -> dict[str, Any]:
    """What the runs before this one recorded that the summary keeps: where they resumed, the faults they took."""
    try:
        summary = read_summary(paths.root)
    except ResultsError:
        return {"resumed_at_steps": [], "faults": []}  # a killed harness wrote none
    return {"resumed_at_steps": list(summary.get("resumed_at_steps") or []), "faults": summary.get("faults") or []}


def checked_resume(run_dir: Path) -> tuple[RunConfig, RunFolder, int]:
    """The interrupted run's config (with a fresh run key for the kernel objects it will make, and without its
    --fault injections, which were the interruption), its folder and the step it resumes from; UserError (one
    sentence) if it cannot be resumed. Creates nothing."""
    from harness.run.inputs import check_unchanged
    from trainers.checkpoint import latest_complete

    folder = RunFolder.interrupted(run_dir)
    paths = RunPaths(folder.current)
    if not paths.config.is_file():
        raise UserError(f"{run_dir} has no config.json, so it holds no run; pass the folder of the run to resume")
    try:
        status = read_summary(paths.root).get("status")
    except ResultsError:
        status = None
    if status == "ok":
        raise UserError(f"the run in {run_dir} finished; there is nothing to resume (rerun it with --config)")
    step = latest_complete(paths.checkpoints)
    if step is None:
        raise UserError(
            f"the run in {run_dir} has no complete checkpoint (it ran without checkpoint_every, or stopped before "
            "its first); start it again with --config"
        )
    try:
        config = RunConfig.load(paths.config)
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise UserError(f"{paths.config} cannot be read as a run's config ({err}); the run cannot be resumed") from None
    recorded = json.loads(paths.config.read_text()).get("inputs") or {}
    check_unchanged(recorded, config.train, paths.config, config.method_source)
    return dataclasses.replace(config, run_key=new_run_key(), faults=()), folder, step
