"""What a replayed link is: the inter_cluster link's rate and/or one-way delay over time, a profile's `trace`.

The rows as parsed from a trace file (harness/net/trace.py, which reads and checks them and says what the link is at
a time); a Profile holds them (harness/net/link.py), and so does a run's config.json.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class TracePoint:
    """One row: in force from `seconds` after training starts until the next row; None where the trace has no such
    column."""

    seconds: float
    rate_bps: int | None = None
    delay_ms: float | None = None


@dataclass(frozen=True)
class LinkTrace:
    """The rows of a trace file, `source`, in time order (the first at 0)."""

    source: str
    points: tuple[TracePoint, ...]

    def to_dict(self) -> dict:
        return {"source": self.source, "points": [dataclasses.asdict(p) for p in self.points]}

    @classmethod
    def from_dict(cls, data: dict) -> LinkTrace:
        return cls(data["source"], tuple(TracePoint(**p) for p in data["points"]))
