"""W&B: the scalars TensorBoard gets, the config and the summary, written offline and read back from W&B's files."""

from __future__ import annotations

import json
import sys

import pytest

from harness.errors import UserError
from harness.run import weights_and_biases
from harness.run.folder import RunPaths
from tests.harness.fakeruns import write_run


def test_without_the_package_the_flag_is_refused_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(
        UserError, match=r"--wandb needs the wandb package; install it with pip install -e '\.\[wandb\]'"
    ):
        weights_and_biases.check_available()


# The .wandb transaction log: a 7-byte header (":W&B", magic, version), then LevelDB log records in 32 KiB blocks,
# each a 7-byte header (CRC, little-endian length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes.
BLOCK_BYTES = 32 * 1024
RECORD_HEADER_BYTES = 7


def _records(wandb_file):
    """Every record of a W&B transaction log (the .wandb file `wandb sync` uploads), by type."""
    from wandb.proto import wandb_internal_pb2

    data = wandb_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, found = RECORD_HEADER_BYTES, b"", {}
    while pos + RECORD_HEADER_BYTES <= len(data):
        left = BLOCK_BYTES - pos % BLOCK_BYTES
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < RECORD_HEADER_BYTES or kind == 0:  # a block's zero padding
            pos += left
            continue
        pending += data[pos + RECORD_HEADER_BYTES : pos + RECORD_HEADER_BYTES + length]
        pos += RECORD_HEADER_BYTES + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            which = record.WhichOneof("record_type")
            found.setdefault(which, []).append(getattr(record, which))
    return found


def test_a_finished_run_is_logged_offline_with_its_scalars_config_and_summary(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "w"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = write_run(tmp_path / "runs", "dl", "opendiloco", val_losses=(5.5, 4.5, 4.0), options={"local_steps": 5})
    assert weights_and_biases.log_runs([(run, "dl")]) == "1 run(s) to W&B project harness (offline)"

    (wandb_file,) = (tmp_path / "w" / "wandb").glob("offline-run-*/run-*.wandb")
    records = _records(wandb_file)
    logged: dict[str, dict[int, float]] = {}
    for history in records["history"]:
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in history.item}
        for key, value in items.items():
            if key != "step" and not key.startswith("_"):
                logged.setdefault(key, {})[items["step"]] = value
    # The evaluations as the events hold them, step by step.
    events = [json.loads(line) for line in RunPaths(run).events(0).read_text().splitlines()]
    evals = {e["step"]: e["val_loss"] for e in events if e["kind"] == "eval"}
    assert logged["val/loss"] == evals
    assert set(logged) >= {"train/loss", "train/lr", "train/tokens_per_s", "sync/payload_bytes"}
    summary = json.loads((run / "summary.json").read_text())
    summarized = {item.key: json.loads(item.value_json) for r in records["summary"] for item in r.update}
    assert summarized["final_val_loss"] == summary["final_val_loss"] == 4.0
    config = {item.key: json.loads(item.value_json) for item in records["run"][0].config.update}
    assert config["method"] == "opendiloco" and config["method_options"]["local_steps"] == 5


@pytest.mark.e2e
def test_a_run_logs_to_wandb_while_it_trains_and_leaves_no_process(tmp_path):
    pytest.importorskip("wandb")
    import os

    from harness.userns import user_namespaces_work
    from tests.harness.e2e import SMALL_RUN, harness, run_marker
    from tests.harness.hoststate import leftovers, snapshot

    if os.geteuid() != 0 and not user_namespaces_work():
        pytest.skip("needs root or user namespaces to build network namespaces")
    before = snapshot()
    out = tmp_path / "run"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    result = harness("run", "--profile", "1gbps", "--steps", 30, *SMALL_RUN, "--wandb", "--out", out, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    (wandb_file,) = (out / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")
    records = _records(wandb_file)
    summary = json.loads((out / "summary.json").read_text())
    summarized = {item.key: json.loads(item.value_json) for r in records["summary"] for item in r.update}
    assert summarized["final_val_loss"] == summary["final_val_loss"]
    assert leftovers(before, run_marker(out)) == {}
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _is_wandb_service(p)]


def _is_wandb_service(pid: str) -> bool:
    try:
        return "wandb-core" in open(f"/proc/{pid}/cmdline").read()
    except OSError:
        return False
