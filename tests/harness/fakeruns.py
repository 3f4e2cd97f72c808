"""Structurally real run folders with made-up numbers, for testing what reads results (report, plots, check).

They are written the way a run writes them: RunConfig.save for config.json, one JSONL event file per rank with
start/eval/step/end events, ranks/rank<R>.json, and summary.json from harness.run.summary.summarize itself, so the
readers see exactly the layout a real run leaves. The numbers are chosen by the test; they are not measurements.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from harness.analysis.plan import build_config
from harness.run.summary import summarize

T0 = 1_800_000_000.0
EVAL_S = 0.5


def write_run(
    root: Path,
    name: str,
    method: str = "allreduce",
    profile: str = "1gbps",
    seed: int = 0,
    tokens_per_s: float = 1000.0,
    wire_bytes_per_token: float = 100.0,
    val_losses: Sequence[float] = (5.5, 4.5, 4.0),
    steps: int = 20,
    blocked_share: float = 0.25,
    overlapped_s: float = 0.0,
    finish_blocked_s: float = 0.0,
    options: dict | None = None,
    failure: str | None = None,
    compute_s: float | Callable[[int, int], float] | None = None,
    sync_every: int = 1,
    applied_steps: int | None = None,
    sync_fields: Callable[[int, int], dict] | None = None,
    finish_fields: dict | None = None,
    wire_factor: float = 1.0,
) -> Path:
    """A finished run whose every step takes tokens_per_step / tokens_per_s seconds; evals spread over the steps.

    finish_blocked_s > 0 adds a `finish` event (communication completed after the last step) to the last step.
    compute_s: each step's forward+backward seconds, a number or a function of (rank, step) [default: the step's
    time less its blocked share]. sync_every: a method that synchronizes logs an exchange every this many steps.
    applied_steps: steps whose updates are in the final parameters [default: all]; tokens_per_s then counts only
    those (applied tokens per second), as a real run does.
    sync_fields: a method's own per-sync fields (already `sync_`-prefixed, as DiLoCoX's), a function of (rank, k) for
    the k-th sync (from 1), added to that sync's step event. finish_fields: added to the `finish` event, which they
    make a run log even without finish_blocked_s. wire_factor: the kernel's wire bytes over the payload bytes the
    sync events carry (TCP/IP framing, retransmissions).
    """
    eval_every = steps // (len(val_losses) - 1)
    config = build_config(method, profile, seed, {"steps": steps, "eval_every": eval_every, **(options or {})})
    run_dir = root / name
    (run_dir / "events").mkdir(parents=True)
    (run_dir / "ranks").mkdir()
    config.save(run_dir / "config.json")
    world = config.clusters * config.stages
    tokens_per_step = config.clusters * config.train.batch_size * 128  # the tiny model's context
    val_tokens = config.train.eval_batches * config.train.batch_size * 128
    step_s = tokens_per_step / tokens_per_s
    syncs = method != "local"
    applied = steps if applied_steps is None else applied_steps
    warmup = config.train.throughput_warmup_steps

    def compute(rank: int, step: int) -> float:
        if compute_s is None:
            return step_s * (1 - blocked_share)
        return compute_s(rank, step) if callable(compute_s) else compute_s

    for rank in range(world):
        t = T0
        events: list[dict] = [{"t": t, "rank": rank, "kind": "start", "tokens_per_step": tokens_per_step}]
        events.append({"t": t, "rank": rank, "kind": "eval", "step": 0, "tokens": 0, "val_loss": val_losses[0],
                       "eval_s": EVAL_S, "val_tokens": val_tokens})  # fmt: skip
        for step in range(steps):
            t += step_s
            event = {"t": t, "rank": rank, "kind": "step", "step": step, "tokens": (step + 1) * tokens_per_step,
                     "loss": val_losses[0], "lr": 4e-4, "compute_s": compute(rank, step),
                     "step_s": step_s}  # fmt: skip
            if syncs and (step + 1) % sync_every == 0:
                event.update(
                    sync_payload_bytes=int(wire_bytes_per_token * tokens_per_step / world),
                    sync_blocked_s=step_s * blocked_share,
                    sync_overlapped_s=overlapped_s,
                )
                if sync_fields is not None:
                    event.update(sync_fields(rank, (step + 1) // sync_every))
            events.append(event)
            if step == steps - 1 and (finish_blocked_s or finish_fields):
                event["step_s"] += finish_blocked_s
                t += finish_blocked_s
                events.append({"t": t, "rank": rank, "kind": "finish", "step": step, "sync_payload_bytes": 0,
                               "sync_blocked_s": finish_blocked_s, "sync_overlapped_s": 0.0,
                               **(finish_fields or {})})  # fmt: skip
            if (step + 1) % eval_every == 0:
                t += EVAL_S
                loss = val_losses[(step + 1) // eval_every]
                events.append({"t": t, "rank": rank, "kind": "eval", "step": step + 1,
                               "tokens": (step + 1) * tokens_per_step, "val_loss": loss, "eval_s": EVAL_S,
                               "val_tokens": val_tokens})  # fmt: skip
        (run_dir / "events" / f"rank{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        window_steps = steps - warmup
        result = {
            "final_train_loss": val_losses[-1],
            "final_val_loss": val_losses[-1],
            "window_steps": window_steps,
            "window_tokens": window_steps * tokens_per_step,
            "window_applied_tokens": max(0, applied - warmup) * tokens_per_step,
            "applied_tokens": applied * tokens_per_step,
            "window_s": window_steps * step_s,
            "tokens": steps * tokens_per_step,
            "optimizer_state_bytes": 1000,
            "wire_bytes": wire_factor * wire_bytes_per_token * steps * tokens_per_step / config.clusters,
        }
        (run_dir / "ranks" / f"rank{rank}.json").write_text(json.dumps(result))
    summary = summarize(config, run_dir, failure, {})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return run_dir


# How a results file gets damaged (a disk that filled up, a copy cut short, a file overwritten by hand) -> what the
# readers (harness/run/folder.py) must say about it.
DAMAGE = {
    "truncated": "cut short",
    "empty": "empty",
    "binary": "binary, not JSON text",
    "list-shaped": "a JSON list, not an object",
    "without method": "lacks method",
}


def damage(path: Path, how: str) -> str:
    """Damages the JSON object file `path` as DAMAGE names it; returns what its reader must say."""
    text = path.read_text()
    if how == "binary":
        path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    else:
        data = json.loads(text)
        data.pop("method", None)
        shown = {"truncated": text[: len(text) // 2], "empty": "", "list-shaped": json.dumps([data])}
        path.write_text(shown.get(how, json.dumps(data)))
    return DAMAGE[how]
