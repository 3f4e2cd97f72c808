"""The harness's own reliability under faults: it never hangs, never crashes on a message, and always tears down."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from pyroute2 import netns

from harness.userns import user_namespaces_work
from tests.harness.e2e import HARNESS, SMALL_RUN, harness, rank_pid, run_marker, summary_of, wait_for_steps
from tests.harness.hoststate import leftovers, snapshot, worker_pids

pytestmark = pytest.mark.e2e

if os.geteuid() != 0 and not user_namespaces_work():
    pytest.skip("needs root or user namespaces to build network namespaces", allow_module_level=True)

LONG_RUN = ["run", "--profile", "100mbps", "--steps", "1000", *SMALL_RUN]


def start(out: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [*HARNESS, *LONG_RUN, *args, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "300", **(env or {})},
    )


def run_key_of(out: Path) -> str:
    import json

    return json.loads((out.parent / f".{out.name}.partial" / "config.json").read_text())["run_key"]


@pytest.mark.alone
def test_a_stopped_worker_fails_the_run_within_the_deadline_naming_it(tmp_path):
    """SIGSTOP: no collective timeout fires, and /proc shows the stopped state at once: the run fails within seconds,
    not after the 300 s watchdog."""
    before = snapshot()
    out = tmp_path / "run"
    proc = start(out, env={"HARNESS_TIMEOUT_S": "300"})
    wait_for_steps(out, 1, 3, proc)
    stopped_at = time.monotonic()
    os.kill(rank_pid(out, 1), signal.SIGSTOP)
    output, _ = proc.communicate(timeout=90)
    elapsed = time.monotonic() - stopped_at
    assert proc.returncode == 1, output
    summary = summary_of(out)
    assert summary["failure"].startswith("rank 1 (cluster 1, stage 0) made no progress for"), summary["failure"]
    assert "its process is stopped" in summary["failure"]
    assert elapsed < 30, elapsed
    assert leftovers(before, run_marker(out)) == {}


def test_forty_ctrl_c_still_leave_a_summary_and_a_clean_host(tmp_path):
    before = snapshot()
    out = tmp_path / "run"
    proc = start(out)
    wait_for_steps(out, 0, 2, proc)
    for _ in range(40):
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGINT)
        time.sleep(0.03)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert "Traceback" not in output, output
    summary = summary_of(out)
    assert summary["status"] == "failed" and summary["interrupted_by"] == "SIGINT"
    assert not (out.parent / f".{out.name}.partial").exists()
    assert leftovers(before, run_marker(out)) == {}


def test_a_vanished_namespace_fails_the_run_saying_so(tmp_path):
    before = snapshot()
    out = tmp_path / "run"
    proc = start(out)
    wait_for_steps(out, 0, 2, proc)
    netns.remove(f"{run_key_of(out)}-sw")
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, output
    failure = summary_of(out)["failure"]
    assert "switch namespace" in failure and "disappeared" in failure, failure
    assert "Traceback" not in output, output
    assert leftovers(before, run_marker(out)) == {}


def test_failure_text_with_brackets_reaches_the_summary_and_the_sweep_goes_on(tmp_path):
    """gloo's errors open with "[/path/pair.cc:NNN]", which rich would read as a closing tag."""
    out = tmp_path / "sweep"
    result = harness(
        "sweep",
        "--methods",
        "allreduce,local",
        "--profiles",
        "1gbps",
        "--seeds",
        "0",
        "--steps",
        "12",
        *SMALL_RUN,
        "--out",
        out,
        env={"HARNESS_FAULT": "1:3", "COLUMNS": "300"},
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "MarkupError" not in result.stdout + result.stderr
    assert result.stdout.count("[/harness/run/worker.py:fault] injected fault") == 2, result.stdout
    assert "0 of 2 runs ok" in result.stdout


@pytest.mark.skipif(not user_namespaces_work(), reason="user namespaces are not available on this machine")
def test_sigterm_to_an_unprivileged_harness_ends_its_inner_run(tmp_path):
    """Without root the harness re-enters itself in a user namespace; a signal to it must reach the inner run."""
    out = tmp_path / "run"
    proc = start(out, env={"HARNESS_USERNS": "always"})
    wait_for_steps(out, 0, 2, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, output
    summary = summary_of(out)
    assert summary["status"] == "failed" and summary["interrupted_by"] == "SIGTERM"
    assert worker_pids(run_marker(out)) == []


@pytest.mark.skipif(not user_namespaces_work(), reason="user namespaces are not available on this machine")
def test_a_killed_unprivileged_harness_takes_its_inner_run_down(tmp_path):
    out = tmp_path / "run"
    proc = start(out, env={"HARNESS_USERNS": "always"})
    wait_for_steps(out, 0, 2, proc)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while not (out / "summary.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    summary = summary_of(out)
    assert summary["status"] == "failed" and summary["interrupted_by"] == "SIGTERM"
    assert worker_pids(run_marker(out)) == []
