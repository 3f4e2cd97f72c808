"""Made-up repeats shaped like the CI gate's (tiny model, 100 Mbit/s, 40 steps, 3 repeats), for the tests of the
baseline file, of `harness baseline` and of `harness check`: a slow-compute machine where allreduce makes ~4,200
tokens/s and local ~10,500.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.run.config import RunConfig
from harness.run.summary import summarize
from tests.harness.fakeruns import write_run

STEPS = 40
OPTIONS = {"dilocox": {"local_steps": 10}, "opendiloco": {"local_steps": 10}}
# method -> (tokens/s, wire bytes per applied token, final validation loss) of the reference machine.
REFERENCE = {
    "allreduce": (4180.0, 3586.0, 3.62),
    "local": (10500.0, 0.5, 3.75),
    "dilocox": (10100.0, 45.3, 3.70),
    "opendiloco": (9900.0, 700.0, 3.58),
    "cocktail": (4800.0, 950.0, 3.80),
}
# Run-to-run noise of the three repeats: tokens/s moves by a few percent, bytes barely, the loss not at all.
TOKEN_JITTER = (1.0, 0.96, 1.03)
WIRE_JITTER = (1.0, 1.002, 0.999)


def fake_run(root, name, method, tokens_per_s, wire, loss, steps=STEPS, seed=0, options=None):
    """write_run, plus what it leaves out: applied tokens (every trained token here), so the summary has
    wire_bytes_per_token per applied token as a real run's does. summary.json is rewritten by summarize itself."""
    options = OPTIONS.get(method, {}) if options is None else options
    run_dir = write_run(
        root, name, method, profile="100mbps", seed=seed, tokens_per_s=tokens_per_s, wire_bytes_per_token=wire,
        val_losses=(5.5, 4.5, loss), steps=steps, options=options,
    )  # fmt: skip
    if json.loads((run_dir / "summary.json").read_text()).get("applied_tokens") is None:
        for rank_file in (run_dir / "ranks").glob("rank*.json"):
            result = json.loads(rank_file.read_text())
            result.update(applied_tokens=result["tokens"], window_applied_tokens=result["window_tokens"])
            rank_file.write_text(json.dumps(result))
        config = RunConfig.load(run_dir / "config.json")
        (run_dir / "summary.json").write_text(json.dumps(summarize(config, run_dir, None, {}), indent=2))
    return run_dir


def write_repeats(root, changes=None, steps=STEPS, seed=0, token_jitter=TOKEN_JITTER):
    """Three repeats of every method; `changes` maps a method to (tokens/s, wire, loss) factors: a regression."""
    for method, (tokens, wire, loss) in REFERENCE.items():
        by_tokens, by_wire, by_loss = (changes or {}).get(method, (1, 1, 1))
        for i, (tj, wj) in enumerate(zip(token_jitter, WIRE_JITTER, strict=True)):
            run = (tokens * by_tokens * tj, wire * by_wire * wj, loss * by_loss)
            fake_run(root, f"{method}-r{i}", method, *run, steps, seed)
    return root


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The reference repeats and the baseline `harness baseline` writes from them (made once: ~15 fake runs)."""
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
