"""What each replica of a fault-tolerant run did when: up (training, or waiting for the others), down (killed, not
restarted yet) or healing (restarted, not healed yet), as spans of seconds from the training's start. From
summary.json's `restarts` and `heals` and the ranks' step events; the timeline figure draws them
(harness/analysis/report/ft_timeline.py)."""

from __future__ import annotations

from typing import Any

UP, DOWN, HEALING = "up", "down", "healing"


def replica_spans(run_id: str, summary: dict[str, Any], events: dict[int, list[dict[str, Any]]]) -> list[dict]:
    """One row per span: run_id, rank, state, start_s, end_s. Empty for a run without fault tolerance or without a
    step."""
    steps = [e for rank_events in events.values() for e in rank_events if e["kind"] == "step"]
    if not summary.get("fault_tolerance") or not steps:
        return []
    t0 = min(e["t"] - e["step_s"] for e in steps)
    end = max(e["t"] for e in steps)
    restarts = summary.get("restarts") or []
    heals = {(h["rank"], h["incarnation"]): h for h in summary.get("heals") or []}
    rows = []

    def span(rank: int, state: str, start: float, stop: float) -> None:
        if stop > start:
            rows.append({"run_id": run_id, "rank": rank, "state": state, "start_s": start - t0, "end_s": stop - t0})

    for rank in sorted(events):
        alive_from = t0
        for restart in sorted((r for r in restarts if r["rank"] == rank), key=lambda r: r["killed_t"]):
            span(rank, UP, alive_from, restart["killed_t"])
            restarted = restart.get("restarted_t", end)
            span(rank, DOWN, restart["killed_t"], restarted)
            heal_s = heals.get((rank, restart["incarnation"]), {}).get("heal_s")
            alive_from = restarted + heal_s if heal_s is not None else end
            span(rank, HEALING, restarted, min(alive_from, end))
        span(rank, UP, alive_from, end)
    return rows
