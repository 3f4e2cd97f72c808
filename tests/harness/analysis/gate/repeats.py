"""Made-up repeats shaped like the CI gate's (tiny model, 40 steps, 5 repeats; DiLoCoX on 10 Mbit/s, the others on
100 Mbit/s), for the tests of the baseline file, of `harness baseline` and of `harness check`.

Each run is consistent with the link model: its steps take their forward and backward (`compute_s`) times the
method's step overhead, plus the wait on the link that harness project's model predicts for that compute (spread
over the steps), so a machine twice as fast halves the compute and keeps the link's seconds, as a real one does.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from harness.analysis.plan import build_config
from harness.analysis.projection.link_model import Compute, LinkModel, default_window_bytes
from harness.analysis.projection.project import predict
from harness.cli import main
from harness.run.config import RunConfig
from harness.run.summary import summarize
from tests.harness.fakeruns import write_run

STEPS = 40
REPEATS = 5
OPTIONS = {
    "cocktail": {"warmup_steps": 2},
    "dilocox": {"local_steps": 10, "overlap_steps": 5},
    "opendiloco": {"local_steps": 10},
}
PROFILES = {"dilocox": "10mbps"}
COMPUTE_S = 0.07  # forward and backward per step on the reference machine
WIRE_OVERHEAD = 1.05
# method -> (step overhead, payload bytes per applied token, final validation loss) of the reference repeats.
REFERENCE = {
    "allreduce": (1.10, 3420.0, 3.662),
    "local": (1.055, 0.0, 3.686),
    "dilocox": (1.23, 27.3, 3.484),
    "opendiloco": (1.066, 171.0, 3.214),
    "cocktail": (2.2, 211.9, 4.035),
}
# Run-to-run noise: a step's overhead moves by about 1%, the wire a hair, bytes and loss not at all.
OVERHEAD_JITTER = (1.0, 0.99, 1.01, 1.005, 0.995)
WIRE_JITTER = (1.0, 1.002, 0.999, 1.001, 0.998)


def step_seconds(method, profile, options, compute_s, overhead):
    """(a step's seconds, of which waiting on the link) as the link model predicts for that compute."""
    config = build_config(method, profile, 0, {"steps": STEPS, "eval_every": STEPS // 2, **options})
    own = compute_s * overhead
    if method == "local":
        return own, 0.0
    link = LinkModel.of(config.profile, config.clusters, window_bytes=default_window_bytes())
    tokens_per_step = config.clusters * config.train.batch_size * 128
    prediction = predict(config, tokens_per_step, Compute(own, compute_s, "made up"), link)
    train = config.train
    window = prediction.schedule.window_s(own, compute_s, STEPS, train.throughput_warmup_steps)
    step_s = window / (STEPS - train.throughput_warmup_steps)
    return step_s, step_s - own


def fake_run(root, name, method, overhead, payload, loss, steps=STEPS, seed=0, options=None, compute_s=COMPUTE_S,
             exposed_s=None, wire_overhead=WIRE_OVERHEAD):  # fmt: skip
    """write_run with steps of compute_s x overhead plus the predicted wait (or `exposed_s` of it per step), and
    what write_run leaves out: applied tokens (every trained token here). summary.json is rewritten by summarize."""
    options = OPTIONS.get(method, {}) if options is None else options
    profile = PROFILES.get(method, "100mbps")
    step_s, blocked_s = step_seconds(method, profile, options, compute_s, overhead)
    if exposed_s is not None:
        step_s, blocked_s = step_s - blocked_s + exposed_s, exposed_s
    tokens_per_step = 2 * 8 * 128
    run_dir = write_run(
        root, name, method, profile=profile, seed=seed, tokens_per_s=tokens_per_step / step_s,
        wire_bytes_per_token=payload, val_losses=(5.5, 4.5, loss), steps=steps, options=options,
        blocked_share=blocked_s / step_s, compute_s=compute_s, wire_factor=wire_overhead,
    )  # fmt: skip
    if json.loads((run_dir / "summary.json").read_text()).get("applied_tokens") is None:
        for rank_file in (run_dir / "ranks").glob("rank*.json"):
            result = json.loads(rank_file.read_text())
            result.update(applied_tokens=result["tokens"], window_applied_tokens=result["window_tokens"])
            rank_file.write_text(json.dumps(result))
        config = RunConfig.load(run_dir / "config.json")
        (run_dir / "summary.json").write_text(json.dumps(summarize(config, run_dir, None, {}), indent=2))
    return run_dir


def write_repeats(root, changes=None, steps=STEPS, seed=0, compute_s=COMPUTE_S, jitter=OVERHEAD_JITTER, **kwargs):
    """REPEATS repeats of every method; `changes` maps a method to (overhead, payload, loss) factors: a
    regression. compute_s: the machine's speed; kwargs go to every fake_run."""
    wire_overhead = kwargs.pop("wire_overhead", WIRE_OVERHEAD)
    for method, (overhead, payload, loss) in REFERENCE.items():
        by_overhead, by_payload, by_loss = (changes or {}).get(method, (1, 1, 1))
        for i, (oj, wj) in enumerate(zip(jitter, WIRE_JITTER, strict=True)):
            fake_run(
                root, f"{method}-r{i}", method, overhead * by_overhead * oj, payload * by_payload, loss * by_loss,
                steps, seed, compute_s=compute_s, wire_overhead=wire_overhead * wj,
                **kwargs,
            )  # fmt: skip
    return root


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The reference repeats and the baseline `harness baseline` writes from them (made once: 25 fake runs)."""
    folder = tmp_path_factory.mktemp("reference")
    results = write_repeats(folder / "repeats")
    out = folder / "baseline.yaml"
    made = CliRunner().invoke(main, ["baseline", str(results), "--out", str(out)])
    assert made.exit_code == 0, made.output
    return results, out


def check(*args):
    return CliRunner().invoke(main, ["check", *map(str, args)])


def verdicts(output):
    """(method, metric) -> verdict, from the table `harness check` prints."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in output.splitlines() if line.startswith("| ")]
    return {(r[1], r[3]): r[0] for r in rows[1:]}
