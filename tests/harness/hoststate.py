"""What a run may leave on the host: namespaces, links, worker processes. Used to prove teardown."""

from __future__ import annotations

import os
from pathlib import Path

from pyroute2 import IPRoute


def netns_names() -> set[str]:
    path = Path("/run/netns")
    return set(os.listdir(path)) if path.is_dir() else set()


def link_names() -> set[str]:
    with IPRoute() as ip:
        return {link.get_attr("IFLA_IFNAME") for link in ip.get_links()}


def worker_pids(run_dir: str) -> list[int]:
    """PIDs of the workers of exactly one run: `python -m harness.worker --run-dir RUN_DIR`, matched argument by
    argument, so a test never touches another run's processes."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "harness.worker" in argv and "--run-dir" in argv and run_dir in argv:
            found.append(int(entry.name))
    return found


def snapshot() -> dict[str, set[str]]:
    return {"netns": netns_names(), "links": link_names()}


def leftovers(before: dict[str, set[str]], run_dir: str) -> dict[str, object]:
    """Everything present now that was not before, plus any worker of the run still alive."""
    now = snapshot()
    found = {k: sorted(now[k] - before[k]) for k in now if now[k] - before[k]}
    pids = worker_pids(run_dir)
    if pids:
        found["workers"] = pids
    return found
