"""The method from outside the repository that docs/writing-a-method.md shows (examples/local_int8.py), through the
CLI as a user runs it: a run on a shaped link whose bytes are the algorithm's by hand, its projection, its rerun by
`harness reproduce` in fresh processes, and a sweep and report of it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness.userns import user_namespaces_work
from tests.harness.e2e import SMALL_RUN, harness, run_marker, summary_of
from tests.harness.hoststate import leftovers, snapshot

EXAMPLE = f"{Path(__file__).resolve().parents[2] / 'examples' / 'local_int8.py'}:LocalInt8"
TINY_PARAMETERS = 875_520


def test_its_projection_comes_from_its_own_sync_plan():
    result = harness(
        "project", "--method", EXAMPLE, "--compute-s", 0.05, "--profile", "100mbps", "--model", "tiny",
        "--set", "local_steps=10", env={"COLUMNS": "250"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # int8 codes, one per parameter, and one fp32 scale, every 10 steps.
    assert f"{TINY_PARAMETERS + 4:,} B from each site every 10 step(s)" in result.stdout, result.stdout


@pytest.mark.e2e
@pytest.mark.skipif(
    os.geteuid() != 0 and not user_namespaces_work(), reason="needs root or user namespaces to build network namespaces"
)
def test_it_runs_on_a_shaped_link_reproduces_and_sweeps(tmp_path):
    before = snapshot()
    first = tmp_path / "first"
    made = harness(
        "run", "--profile", "100mbps", "--method", EXAMPLE, "--steps", 40, "--set", "local_steps=10",
        *SMALL_RUN, "--seq-len", 64, "--out", first,
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    summary = summary_of(first)
    assert summary["status"] == "ok" and summary["method"] == "localint8"
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0
    # Every 10 steps each of the 2 ranks sends its codes and scale to the other: 4 times in 40 steps.
    assert summary["sync_count"] == 4
    assert summary["payload_bytes"] == 4 * 2 * (TINY_PARAMETERS + 4)
    assert 1.0 <= summary["wire_bytes"] / summary["payload_bytes"] < 1.1
    config = json.loads((first / "config.json").read_text())
    assert config["method_source"] == EXAMPLE and len(config["inputs"]["method"]["sha256"]) == 64

    again = harness("reproduce", first, "--out", tmp_path / "again", env={"COLUMNS": "250"})
    assert again.returncode == 0, again.stdout + again.stderr
    assert "identical on every rank" in again.stdout, again.stdout

    sweep = tmp_path / "sweep"
    swept = harness(
        "sweep", "--methods", EXAMPLE, "--profiles", "100mbps", "--steps", 4, "--set", "local_steps=2",
        *SMALL_RUN, "--seq-len", 32, "--out", sweep,
    )  # fmt: skip
    assert swept.returncode == 0, swept.stdout + swept.stderr
    report = harness("report", sweep, env={"COLUMNS": "250"})
    assert report.returncode == 0 and "| localint8 " in report.stdout, report.stdout + report.stderr
    assert leftovers(before, run_marker(first)) == {}


def test_the_page_shows_the_example_as_it_is():
    root = Path(__file__).resolve().parents[2]
    example = (root / "examples" / "local_int8.py").read_text()
    assert f"```python\n{example}```" in (root / "docs" / "writing-a-method.md").read_text()
    assert len(example.splitlines()) <= 40
