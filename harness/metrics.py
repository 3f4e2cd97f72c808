"""Per-rank JSONL events and the kernel's wire-byte counters.

Each rank appends one JSON object per line to events/rank<R>.jsonl and flushes it, so a run that dies keeps every
event written before it died. Wire bytes come from the kernel's interface counters (netlink IFLA_STATS64), read in
the namespace that holds the interface: they count every byte that really crossed the link, headers included.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute


class EventWriter:
    def __init__(self, path: Path, **stamp: Any):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)
        self._stamp = stamp

    def __call__(self, event: dict[str, Any]) -> None:
        self._file.write(json.dumps({"t": time.time(), **self._stamp, **event}) + "\n")

    def close(self) -> None:
        self._file.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    """All complete events of one file; a line cut short by a killed writer is skipped."""
    events = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


class EventTail:
    """Reads the events appended to a file since the last call (for the live progress display)."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
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


def interface_counters(ip: IPRoute, ifname: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of `ifname` as the kernel counts them, seen through `ip` (an IPRoute or NetNS)."""
    (link,) = ip.get_links(ifname=ifname)
    stats = link.get_attr("IFLA_STATS64")
    return stats["tx_bytes"], stats["rx_bytes"]


class LinkCounter:
    """Bytes this namespace has sent on its uplink; read by the worker inside the cluster's namespace."""

    def __init__(self, ifname: str):
        self.ifname = ifname
        self._ip = IPRoute()

    def tx_bytes(self) -> int:
        return interface_counters(self._ip, self.ifname)[0]

    def close(self) -> None:
        self._ip.close()
