"""What a run may leave on the host: namespaces, links, worker processes. Used to prove teardown."""

from __future__ import annotations

import json
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
    """PIDs of the processes of exactly one run: `python -m harness.run.worker --run-dir RUN_DIR` (and its torchft
    lighthouse, `harness.run.fault_tolerance`), matched argument by argument, so a test never touches another run's
    processes."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        run_module = "harness.run.worker" in argv or "harness.run.fault_tolerance" in argv
        if run_module and "--run-dir" in argv and run_dir in argv:
            found.append(int(entry.name))
    return found


def snapshot() -> dict[str, set[str]]:
    return {"netns": netns_names(), "links": link_names()}


def _run_key(run_dir: str) -> str | None:
    """The run key of the run staged at `run_dir` (`.<name>.partial`), from its final or staging config.json."""
    staging = Path(run_dir)
    final = staging.parent / staging.name.removeprefix(".").removesuffix(".partial")
    for folder in (final, staging):
        try:
            return json.loads((folder / "config.json").read_text())["run_key"]
        except (OSError, ValueError, KeyError):
            continue
    return None


def leftovers(before: dict[str, set[str]], run_dir: str) -> dict[str, object]:
    """What this run left: new namespaces and links carrying its run key (every object a run makes does; other
    runs on the host come and go meanwhile), plus any worker of the run still alive. Without a readable run key,
    everything new counts."""
    now = snapshot()
    key = _run_key(run_dir)
    found = {k: sorted(name for name in now[k] - before[k] if key is None or name.startswith(key)) for k in now}
    found = {k: v for k, v in found.items() if v}
    pids = worker_pids(run_dir)
    if pids:
        found["workers"] = pids
    return found
