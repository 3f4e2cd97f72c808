"""Failures that heal, on real runs (`--set fault_tolerance=torchft`): a replica killed mid-run restarts, fetches its
peer's state across the shaped link and the run ends ok with every replica holding the same parameters; at three
sites the survivors train on while it is down; Ctrl-C while a replica heals leaves the host clean."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from harness.userns import user_namespaces_work
from tests.harness.e2e import HARNESS, harness, run_marker, summary_of
from tests.harness.hoststate import leftovers, snapshot

pytestmark = pytest.mark.e2e

if os.geteuid() != 0 and not user_namespaces_work():
    pytest.skip("needs root or user namespaces to build network namespaces", allow_module_level=True)
pytest.importorskip("torchft", reason="fault tolerance runs on torchft (pip install -e '.[ft]')")

FT_SHAPE = [
    "--profile", "100mbps", "--model", "tiny", "--batch-size", "2", "--seq-len", "64", "--eval-every", "20",
    "--set", "fault_tolerance=torchft",
]  # fmt: skip
FT_RUN = [*FT_SHAPE, "--set", "replica_timeout_s=10", "--set", "restart_delay_s=1"]


def events(out, rank):
    return [json.loads(line) for line in (out / "events" / f"rank{rank}.jsonl").read_text().splitlines()]


def final_evaluations(out, ranks=(0, 1)):
    """Each rank's last evaluation: the same validation batches on each replica's parameters."""
    return {rank: [e for e in events(out, rank) if e["kind"] == "eval"][-1] for rank in ranks}


def test_a_killed_replica_heals_from_its_peer_and_the_run_ends_with_equal_replicas(tmp_path):
    """DiLoCoX: rounds (OpenDiLoCo's, plus a streaming overlap and adaptive round lengths) and its int4 factors
    all-gathered on torchft's group; AllReduce's all-reduce is the three-site test's."""
    before = snapshot()
    out = tmp_path / "run"
    result = harness(
        "run", "--method", "dilocox", "--set", "local_steps=10", "--steps", 60, *FT_RUN, "--fault", "kill:25:1",
        "--out", out,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    summary = summary_of(out)
    assert summary["status"] == "ok" and summary["steps"] == 60
    (heal,) = summary["heals"]
    assert heal["rank"] == 1 and heal["down_s"] >= 1.0
    # The kill comes once rank 0 has done 25 steps; replicas meet at rounds' ends, so rank 1 was in that round.
    rounds_of_peer = {e["from_step"] for e in events(out, 0) if e["kind"] == "commit"}
    assert heal["killed_at_step"] >= max(r for r in rounds_of_peer if r <= 25)
    # The restarted replica took its peer's round: a round the peer committed from, not its own step 0.
    assert heal["healed_to_step"] > 0 and heal["healed_to_step"] in rounds_of_peer
    # What crossed the link to heal is the state torch serializes, plus TCP/IP and HTTP headers (a few %).
    assert heal["heal_state_bytes"] <= heal["heal_received_bytes"] <= 1.05 * heal["heal_state_bytes"]
    quorums = [e for e in events(out, 1) if e["kind"] == "quorum" and "healed_to_step" in e]
    assert [q["healed_to_step"] for q in quorums] == [heal["healed_to_step"]]
    # After the last exchange every replica holds the same parameters: the same loss on the same batches.
    evaluations = final_evaluations(out)
    assert evaluations[0]["step"] == evaluations[1]["step"] == 60
    assert evaluations[0]["val_loss"] == evaluations[1]["val_loss"]
    # Every step is in the final model: discarded rounds were trained again, and the applied tokens count each
    # step's replicas (fewer while one was down).
    assert 60 * 2 * 64 <= summary["ft_applied_tokens"] <= 60 * 2 * 2 * 64
    assert summary["goodput_tokens_per_s"] > 0
    assert leftovers(before, run_marker(out)) == {}


def test_at_three_sites_the_survivors_train_on_while_the_failed_replica_is_down(tmp_path):
    """AllReduce (FT-DDP), 3 sites, replica 1 killed at step 20 and restarted 12 s later: past torchft's 5 s heartbeat
    the lighthouse drops it, the other two train on as a quorum of two, and replica 1 heals to where they are. The
    survivors give up on the dead peer's exchange within replica_timeout_s (5 s) even where gloo does not notice the
    death, so they train alone well before the restarted replica asks to join (12 s and its start-up)."""
    before = snapshot()
    out = tmp_path / "run"
    argv = ["--steps", 100, *FT_SHAPE, "--clusters", 3, "--set", "replica_timeout_s=5", "--set", "restart_delay_s=12"]
    argv += ["--fault", "kill:20:1"]
    result = harness("run", "--method", "allreduce", *argv, "--out", out)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = summary_of(out)
    assert summary["status"] == "ok" and summary["steps"] == 100
    (heal,) = summary["heals"]
    assert heal["rank"] == 1 and heal["down_s"] >= 12.0
    killed, healed = heal["killed_at_step"], heal["healed_to_step"]
    assert healed > killed + 1, "the survivors waited for the failed replica instead of training on"
    for survivor in (0, 2):
        alone = [e["from_step"] for e in events(out, survivor) if e["kind"] == "commit" and e["participants"] == 2]
        # From the step replica 1 died in (or the next, had its last exchange gone through) to the one it healed to.
        assert alone == list(range(alone[0], healed)) and abs(alone[0] - killed) <= 1
    # The steps replica 1 missed are the only ones not applied three times over.
    assert summary["ft_applied_fraction"] == pytest.approx(1 - len(alone) / (3 * 100))
    evaluations = final_evaluations(out, (0, 1, 2))
    assert len({(e["step"], e["val_loss"]) for e in evaluations.values()}) == 1
    assert leftovers(before, run_marker(out)) == {}


def test_ctrl_c_while_a_replica_heals_leaves_the_host_clean(tmp_path):
    before = snapshot()
    out = tmp_path / "run"
    argv = [*HARNESS, "run", "--method", "allreduce", "--steps", "400", *FT_RUN, "--fault", "kill:10:1"]
    proc = subprocess.Popen([*argv, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    faults = out.parent / f".{out.name}.partial" / "events" / "faults.jsonl"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if faults.exists() and '"restarted"' in faults.read_text():
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[0]
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 130, output
    summary = summary_of(out)
    assert summary["status"] == "failed" and "interrupted by SIGINT" in summary["failure"]
    assert [r["rank"] for r in summary["restarts"]] == [1]
    assert leftovers(before, run_marker(out)) == {}
