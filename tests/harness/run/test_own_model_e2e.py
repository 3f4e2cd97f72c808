"""Real runs of a user's own model, tokenizer and data: transformers configs of OPT-125m's and Qwen2-0.5B's widths
(2 layers, untied so that two stages can cut them), a byte-level BPE of 512 tokens trained on the run's corpus, and
that corpus as a parquet file and a saved `datasets` folder, on kernel-shaped links."""

from __future__ import annotations

import json
import math
import os
import sysconfig
from pathlib import Path

import pytest

from harness.userns import user_namespaces_work
from tests.harness.e2e import harness, run_marker, summary_of
from tests.harness.hoststate import leftovers, snapshot
from tests.trainers import hf_configs
from trainers.models import count_parameters, get_model_config

pytestmark = pytest.mark.e2e

if os.geteuid() != 0 and not user_namespaces_work():
    pytest.skip("needs root or user namespaces to build network namespaces", allow_module_level=True)

# The fastest rate two cores shape faithfully: AllReduce's 5 full exchanges of the 30M-parameter Qwen2 take ~10 s.
PROFILE = "1gbps"
RUN = ["--steps", 5, "--seq-len", 64, "--batch-size", 4, "--tokenizer", "bpe:512"]


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> dict[str, Path]:
    """Both models, and 40 modules of the standard library as a parquet file and as a saved dataset."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("own")
    texts = [p.read_text() for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]]
    pq.write_table(pa.table({"text": texts}), root / "docs.parquet")
    datasets.Dataset.from_dict({"content": texts}).save_to_disk(str(root / "docs-dataset"))
    return {
        "opt-125m": hf_configs.opt_125m(root / "opt-125m", untied=True),
        "qwen2-0.5b": hf_configs.qwen2_05b(root / "qwen2-0.5b", untied=True),
        "parquet": root / "docs.parquet",
        "dataset": root / "docs-dataset",
        "cache": root / "cache",
    }


# Each run costs 30-55 s of the suite, so two of the six (model, method, stages) triples, which between them take
# each model, each method, one and two stages and both kinds of local data once: OPT whole under AllReduce, and the
# one that cuts the most (2 stages of Qwen2's GQA blocks under DiLoCoX, with --tensorboard). Every triple passed when
# this was written; the layer cut itself is checked for every family in tests/trainers/test_hf_models.py.
@pytest.mark.parametrize(("model", "method", "stages"), [("opt-125m", "allreduce", 1), ("qwen2-0.5b", "dilocox", 2)])
def test_a_transformers_model_trains_on_local_data_with_a_trained_bpe(own, model, method, stages, tmp_path):
    # The OPT runs read the parquet file, the Qwen2 runs the saved dataset (whose text is in "content").
    data = ["--data", own["parquet"]] if model == "opt-125m" else ["--data", own["dataset"], "--data-field", "content"]
    # One DiLoCoX round, at the last step: a round's rank estimate and monitors cost seconds of CPU at these widths.
    extra = ["--set", "local_steps=5"] if method == "dilocox" else []
    # One run also writes its scalars for TensorBoard as it trains.
    tensorboard = model == "qwen2-0.5b" and stages == 2
    extra += ["--tensorboard"] if tensorboard else []
    before = snapshot()
    out = tmp_path / "run"
    result = harness(
        "run",
        "--method",
        method,
        "--model",
        own[model],
        "--stages",
        stages,
        *RUN,
        "--profile",
        PROFILE,
        *data,
        *extra,
        "--out",
        out,
        env={"HARNESS_CACHE_DIR": str(own["cache"])},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = summary_of(out)
    assert summary["status"] == "ok" and summary["steps"] == 5, summary["failure"]
    assert summary["param_count"] == count_parameters(get_model_config(str(own[model])))
    start = json.loads((out / "events" / "rank0.jsonl").read_text().splitlines()[0])
    assert start["vocab_size"] == 512 and "byte-level BPE" in start["tokenizer"]
    # BPE tokens each cover more than one byte of text, so bits per byte is the loss per token spread thinner.
    assert 0 < start["val_tokens_per_byte"] < 1
    assert summary["final_val_bpb"] == pytest.approx(
        summary["final_val_loss"] / math.log(2) * start["val_tokens_per_byte"], rel=1e-6
    )
    # Real text and real learning, even in 5 steps: from the uniform ln 512 = 6.24 downwards.
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.3
    assert summary["wire_bytes"] > summary["payload_bytes"] > 0
    assert sorted(p.name for p in (out / "events").glob("rank*.jsonl")) == [f"rank{r}.jsonl" for r in range(2 * stages)]
    assert leftovers(before, run_marker(out)) == {}
    assert "bits/byte" in result.stdout
    if tensorboard:
        _check_tensorboard(out, summary, tmp_path / "report-tb")


def _check_tensorboard(run: Path, summary: dict, report_dir: Path) -> None:
    """The live writer's event files, read back with tensorboard's reader, hold the run's figures; `harness report
    --tensorboard` writes the same from the finished folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
        acc = EventAccumulator(str(log_dir))
        acc.Reload()
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    live = scalars(run / "tensorboard")
    assert [s for s, _ in live["train/loss"]] == list(range(5))
    assert live["val/loss"][0] == (0, pytest.approx(summary["initial_val_loss"]))
    assert live["val/loss"][-1] == (5, pytest.approx(summary["final_val_loss"]))
    assert live["val/bits_per_byte"][-1][1] == pytest.approx(summary["final_val_bpb"], rel=1e-6)
    assert {"train/tokens_per_s", "link/wire_bytes", "link/utilization", "sync/payload_bytes"} <= set(live)
    result = harness("report", run, "--tensorboard", report_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert scalars(report_dir / run.name) == live


def test_the_bpe_is_trained_once_and_cached_beside_the_corpus(own):
    """After the runs above (module order): one trained tokenizer per corpus, keyed by the corpus's hash."""
    if not (own["cache"] / "corpora").exists():
        pytest.skip("runs only after the runs above, which fill the cache")
    folders = sorted((own["cache"] / "corpora").iterdir())
    # The parquet file and the dataset hold the same documents, but they are two corpora as sources.
    assert 1 <= len(folders) <= 2, folders
    for folder in folders:
        assert (folder / "bpe-512.json").is_file(), sorted(folder.iterdir())
