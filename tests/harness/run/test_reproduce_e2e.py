"""`harness reproduce` on a real run: on the same machine and code, every step's loss repeats exactly."""

from __future__ import annotations

import json
import os

import pytest

from harness.userns import user_namespaces_work
from tests.harness.e2e import SMALL_RUN, harness, run_marker, summary_of
from tests.harness.hoststate import leftovers, snapshot

pytestmark = pytest.mark.e2e

if os.geteuid() != 0 and not user_namespaces_work():
    pytest.skip("needs root or user namespaces to build network namespaces", allow_module_level=True)


def test_a_dilocox_run_reproduces_to_the_last_bit(tmp_path):
    before = snapshot()
    first, again = tmp_path / "first", tmp_path / "again"
    made = harness(
        "run", "--profile", "100mbps", "--method", "dilocox", "--steps", 30, "--set", "local_steps=5",
        *SMALL_RUN, "--seq-len", 64, "--out", first,
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    result = harness("reproduce", first, "--out", again, env={"COLUMNS": "250"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "identical on every rank" in result.stdout, result.stdout
    stored, rerun = summary_of(first), summary_of(again)
    assert rerun["final_val_loss"] == stored["final_val_loss"]
    assert abs(rerun["wire_bytes"] / stored["wire_bytes"] - 1) < 0.01
    config = json.loads((again / "config.json").read_text())
    assert config["method"] == "dilocox" and config["method_options"] == stored["method_options"]
    assert leftovers(before, run_marker(again)) == {}
