"""Per-rank JSONL events: what each rank did, one JSON object per line.

Each rank appends one event per line to events/rank<R>.jsonl and flushes it, so a run that dies keeps every event
written before it died. They are read back through harness/run/folder.py's read_events; EventTail follows them live.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class EventWriter:
    def __init__(self, path: Path, **stamp: Any):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)
        self._stamp = stamp

    def __call__(self, event: dict[str, Any]) -> None:
        self._file.write(json.dumps({"t": time.time(), **self._stamp, **event}) + "\n")

    def close(self) -> None:
        self._file.close()


class EventTail:
    """Reads the events appended to a file since the last call (for the live progress display)."""

    def __init__(self, path: Path, offset: int = 0):
        """`offset`: where in the file to start (0: every event; the file's size: those appended from now on)."""
        self.path = path
        self._offset = offset
        self._partial = ""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        with self.path.open() as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if line:
                yield json.loads(line)
