"""Real interrupted runs resumed on kernel-shaped links (`harness run --set checkpoint_every=N` then `--resume`): a run
whose rank was killed, and one stopped with Ctrl-C, each continued in its own folder from its last checkpoint,
end with the same losses, step by step, as the run that was never interrupted, and leave the host clean."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from harness.userns import user_namespaces_work
from tests.harness.e2e import HARNESS, harness, run_marker, summary_of, wait_for_steps
from tests.harness.hoststate import leftovers, snapshot

pytestmark = pytest.mark.e2e

if os.geteuid() != 0 and not user_namespaces_work():
    pytest.skip("needs root or user namespaces to build network namespaces", allow_module_level=True)

# DiLoCoX as it runs by default (streaming overlap, adaptive rank and rounds, error feedback), with rounds short
# enough that a 30-step run holds several, and checkpoints that fall due inside an exchange and between them.
RUN = [
    "--profile", "100mbps", "--method", "dilocox", "--steps", "30", "--set", "checkpoint_every=8", "--model", "tiny",
    "--batch-size", "2", "--seq-len", "64", "--eval-every", "10", "--set", "local_steps=6", "--set", "rank=8",
    "--set", "overlap_steps=2",
]  # fmt: skip


def _losses(out) -> dict[tuple[int, int], float]:
    """(rank, step) -> that step's training loss, from every rank's events."""
    losses = {}
    for path in sorted((out / "events").glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["kind"] == "step":
                losses[(rank, event["step"])] = event["loss"]
    return losses


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    result = harness("run", *RUN, "--out", out)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def _resume_and_compare(out, uninterrupted, before) -> dict:
    result = harness("run", "--resume", out)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = summary_of(out)
    assert summary["status"] == "ok" and summary["steps"] == 30
    (step,) = summary["resumed_at_steps"]
    assert f"from its checkpoint at step {step}" in result.stdout and "resumed" in result.stdout
    whole = summary_of(uninterrupted)
    # Bit for bit: every rank's every step, and the held-out losses, as if the run had never stopped.
    assert _losses(out) == _losses(uninterrupted)
    for key in ("final_val_loss", "initial_val_loss", "applied_tokens", "sync_count"):
        assert summary[key] == whole[key], key
    # The ranks' bytes on the wire count every step in the record once (the kernel's counters, so TCP's own
    # variation aside): the steps trained twice are not counted twice.
    assert abs(summary["wire_bytes"] / whole["wire_bytes"] - 1) < 0.02, (summary["wire_bytes"], whole["wire_bytes"])
    assert not (out.parent / f".{out.name}.partial").exists()
    assert leftovers(before, run_marker(out)) == {}
    return summary


def test_a_run_whose_rank_was_killed_resumes_from_its_last_checkpoint_to_the_same_losses(tmp_path, uninterrupted):
    before = snapshot()
    out = tmp_path / "killed"
    result = harness("run", *RUN, "--fault", "kill:20:1", "--out", out)
    assert result.returncode == 1, result.stdout + result.stderr
    assert summary_of(out)["status"] == "failed"
    summary = _resume_and_compare(out, uninterrupted, before)
    assert 8 <= summary["resumed_at_steps"][0] <= 20
    assert summary["faults_before_resume"][0]["fault"] == "kill"


def test_a_run_stopped_with_ctrl_c_resumes_to_the_same_losses(tmp_path, uninterrupted):
    before = snapshot()
    out = tmp_path / "stopped"
    argv = [*HARNESS, "run", *RUN, "--out", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for_steps(out, 0, 20, proc)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert summary_of(out)["status"] == "failed"
    _resume_and_compare(out, uninterrupted, before)
    # A finished run has nothing left to resume.
    again = harness("run", "--resume", out)
    assert again.returncode != 0 and "nothing to resume" in again.stderr
