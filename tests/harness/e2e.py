"""Helpers for the end-to-end tests: run the harness CLI as a subprocess and read what a run wrote.

Shared by tests/harness/run/test_run_e2e.py (netns backend) and tests/harness/backends/test_docker_backend.py.
Importing this module does nothing else: no skip, no engine, no namespace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.harness.hoststate import worker_pids

HARNESS = [sys.executable, "-m", "harness.cli"]
SMALL_RUN = ["--model", "tiny", "--batch-size", "4", "--eval-every", "20"]


def harness(*args: object, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*HARNESS, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def summary_of(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def wait_for_steps(out: Path, rank: int, steps: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Block until `rank` has logged `steps` steps in the run's (staging) folder."""
    events = out.parent / f".{out.name}.partial" / "events" / f"rank{rank}.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if events.exists() and events.read_text().count('"kind": "step"') >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} logged fewer than {steps} steps in {timeout}s")


def run_marker(out: Path) -> str:
    """The staging folder every worker of this run has on its command line (--run-dir): unique to the run."""
    return str(out.parent / f".{out.name}.partial")


def rank_pid(out: Path, rank: int) -> int:
    for pid in worker_pids(run_marker(out)):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker process for rank {rank}")
