"""harness project's model (harness/analysis/projection/link_model.py, project.py): the link's arithmetic, each
method's bytes as the method itself counts them, a run's window, and the validation against runs."""

from __future__ import annotations

import json
import operator
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.analysis.projection import link_model, project
from harness.analysis.projection.link_model import LinkModel, ProjectionError, Schedule
from harness.cli import main
from harness.net.profiles import load_profile
from harness.run.config import RunConfig
from tests.harness.fakeruns import write_run
from trainers.config import TrainConfig

LINK_100M_160MS = LinkModel(100e6, 0.160, efficiency=0.94, window_bytes=4 << 20)


def schedule(method, options, model, n, link):
    """What harness project makes of the schedule the method declares, for a run of it with these options."""
    return link_model.schedule(RunConfig.build(method, "unshaped", clusters=n, model=model, **options), link)


def test_collectives_pay_their_bytes_at_the_goodput_and_one_rtt_per_ring_step():
    link = LINK_100M_160MS
    assert link.goodput_bps == pytest.approx(94e6)
    # 4 sites: each sends 2(n-1)/n of 8 MB = 12 MB in 2(n-1) = 6 ring steps.
    assert link.allreduce_s(8_000_000, 4) == pytest.approx(8 * 12e6 / 94e6 + 6 * 0.160)
    assert link.allgather_s(1_000_000, 4) == pytest.approx(8 * 3e6 / 94e6 + 3 * 0.160)
    # A window of 1 MB over 160 ms carries 50 Mbit/s, below the 94 the rate allows.
    assert LinkModel(100e6, 0.160, window_bytes=1_000_000).goodput_bps == pytest.approx(50e6)
    assert LinkModel(None, 0.0).allreduce_s(10**9, 2) == 0.0


def test_slow_start_doubles_from_ten_segments_each_round_trip():
    link = LINK_100M_160MS
    # 1.75 MB: six round trips carry 14,480 B x (2^6 - 1) = 912,240 B, the 7th window (926,720 B) the other
    # 838,800 B at the goodput; all of it against 1,751,040 B at the goodput. (The run it comes from, OpenDiLoCo on
    # 100 Mbit/s at 160 ms, waited 1.452 s for its first exchange and 0.458 s for each later one: 0.994 s more.)
    expected = 6 * 0.160 + 8 * 838_800 / 94e6 - 8 * 1_751_040 / 94e6
    assert link.slow_start_extra_s(1_751_040) == pytest.approx(expected)
    assert link.slow_start_extra_s(10_000) == 0.0  # inside the initial window
    assert LinkModel(100e6, 0.0).slow_start_extra_s(10**8) == 0.0


# The tiny model's parameter shapes (trainers/models.py): embeddings 256 x 128 and positions 130 x 128, four blocks
# of four 128 x 128 projections with their biases, 512 x 128 and 128 x 512 MLP matrices with theirs, two norms (weight
# and bias) a block and a final one, and the 256 x 128 untied head; 875,520 weights.
TINY_MATRICES = [(256, 128), (130, 128), *[(128, 128)] * 16, *[(512, 128), (128, 512)] * 4, (256, 128)]
TINY_VECTORS = [128] * 38 + [512] * 4


def _quantized_4bit(n: int) -> int:
    """n values at 4 bits, two to a byte, and one fp16 scale per bucket of 128."""
    return -(-n // 2) + 2 * -(-n // 128)


def _cocktail_bytes(n: int) -> int:
    """A tensor of n weights: every 10th in the random mask, the top 20% of those kept at 4 bits, each with its
    position in the mask (1 byte up to 256 positions, else 2)."""
    masked = -(-n // 10)
    kept = round(0.2 * masked)
    return kept * (1 if masked <= 256 else 2) + _quantized_4bit(kept)


def _dilocox_bytes(rank: int) -> int:
    """Rank-r factors (m x r and n x r) of every matrix they shrink, 4-bit; vectors whole at 4 bits; plus the
    adaptive rank's 16-byte all-reduce of its estimates."""
    matrices = sum(
        _quantized_4bit(m * rank) + _quantized_4bit(n * rank) if rank * (m + n) < m * n else _quantized_4bit(m * n)
        for m, n in TINY_MATRICES
    )
    return matrices + sum(_quantized_4bit(n) for n in TINY_VECTORS) + 16


def test_bytes_per_site_follow_each_methods_payload_formula_on_the_tiny_model():
    """Two sites: an all-reduce's ring sends 2(n-1)/n = 1 buffer per site, an all-gather n-1 = 1 payload. These are
    the bytes the first exchange of real 2-site runs logged (3,502,080; 1,751,040; 44,089; 172,574 at r = 32)."""
    weights = sum(m * n for m, n in TINY_MATRICES) + sum(TINY_VECTORS)
    assert weights == 875_520
    expected = {
        "allreduce": 4 * weights,  # fp32
        "opendiloco": 2 * weights,  # fp16 pseudo-gradients
        "cocktail": sum(_cocktail_bytes(m * n) for m, n in TINY_MATRICES) + sum(map(_cocktail_bytes, TINY_VECTORS)),
        "dilocox": _dilocox_bytes(32),
    }
    assert expected == {"allreduce": 3_502_080, "opendiloco": 1_751_040, "cocktail": 44_089, "dilocox": 172_574}
    for method, payload in expected.items():
        options = {"rank": 32} if method == "dilocox" else {}
        assert schedule(method, options, "tiny", 2, LINK_100M_160MS).payload_bytes == payload, method


def test_the_reduce_exchange_pays_both_all_reduces_one_after_the_other():
    link = LINK_100M_160MS
    for n in (2, 8, 20):
        reduce = schedule("dilocox", {"exchange": "reduce"}, "tiny", n, link)
        shapes = link_model.parameter_shapes(TrainConfig(model="tiny"))
        plan = RunConfig.build("dilocox", "unshaped", exchange="reduce").method_config.sync_plan(shapes)
        first, second = (link.allreduce_s(e.nbytes, n) for e in plan.exchanges)
        assert reduce.exchange_s == pytest.approx(first + second)
        assert reduce.payload_bytes == sum(e.payload_bytes(n) for e in plan.exchanges)
    # Per site, the gather's bytes grow with n and the reduce's do not.
    gather_growth = (schedule("dilocox", {}, "tiny", n, link).payload_bytes for n in (2, 20))
    reduce_growth = (schedule("dilocox", {"exchange": "reduce"}, "tiny", n, link).payload_bytes for n in (2, 20))
    assert operator.truediv(*reversed(list(gather_growth))) == pytest.approx(19, rel=0.01)
    assert operator.truediv(*reversed(list(reduce_growth))) == pytest.approx(1.9, rel=0.01)


def test_each_method_hides_its_exchange_behind_its_own_schedule():
    link = LINK_100M_160MS
    assert schedule("allreduce", {}, "tiny", 2, link).hidden_steps == 0
    assert schedule("cocktail", {}, "tiny", 2, link).hidden_steps == 1
    opendiloco = schedule("opendiloco", {"local_steps": 20}, "tiny", 2, link)
    assert (opendiloco.every_steps, opendiloco.hidden_steps) == (20, 0)
    modes = {m: schedule("dilocox", {"local_steps": 50, "overlap": m}, "tiny", 2, link) for m in
             ("none", "streaming", "delayed", "eager")}  # fmt: skip
    assert {m: s.hidden_steps for m, s in modes.items()} == {"none": 0, "streaming": 5, "delayed": 50, "eager": 50}
    fp16 = schedule("dilocox", {"compression": False, "adaptive": False}, "tiny", 2, link)
    assert fp16.payload_bytes == schedule("opendiloco", {}, "tiny", 2, link).payload_bytes
    # Adaptation all-reduces two float64 beside each exchange.
    assert schedule("dilocox", {"compression": False}, "tiny", 2, link).payload_bytes == fp16.payload_bytes + 16


def test_a_step_waits_for_what_compute_does_not_hide():
    sched = Schedule(payload_bytes=1, exchange_s=1.0, every_steps=10, hidden_steps=4)
    assert sched.step_s(compute_s=0.2, hide_s=0.1) == pytest.approx(0.2 + (1.0 - 0.4) / 10)
    assert sched.step_s(compute_s=0.5, hide_s=0.3) == pytest.approx(0.5)


def test_a_runs_window_holds_the_methods_warm_up_and_the_first_exchanges_slow_start():
    sched = Schedule(1, exchange_s=1.0, every_steps=10, hidden_steps=0, first_exchange_extra_s=2.0)
    # Steps 5..29: compute 25 x 0.1, exchanges after steps 9, 19, 29 (the last also the run's end), +2 s for the first.
    assert sched.window_s(0.1, 0.1, steps=30, from_step=5) == pytest.approx(2.5 + 3 * 1.0 + 2.0)
    # A run that ends mid-round synchronizes at its last step.
    assert sched.window_s(0.1, 0.1, steps=25, from_step=5) == pytest.approx(2.0 + 3 * 1.0 + 2.0)
    warm = Schedule(1, exchange_s=0.1, every_steps=1, hidden_steps=1, warmup_steps=8, warmup_exchange_s=1.0)
    # The last step applies the previous exchange (hidden) and waits for its own in full: nothing left to hide it.
    assert warm.window_s(0.2, 0.2, steps=10, from_step=5) == pytest.approx(5 * 0.2 + 3 * 1.0 + 0.1)


def test_a_run_ends_waiting_for_its_last_exchange_in_full():
    """Streaming DiLoCo's round that ends the run sends at its end: its exchange is not hidden as the others are."""
    streaming = Schedule(1, exchange_s=0.3, every_steps=10, hidden_steps=5)
    assert streaming.window_s(0.1, 0.1, steps=20, from_step=0) == pytest.approx(20 * 0.1 + 0.0 + 0.3)
    late = Schedule(1, exchange_s=0.3, every_steps=10, hidden_steps=10)  # delayed: lands a round late
    assert late.window_s(0.1, 0.1, steps=20, from_step=0) == pytest.approx(20 * 0.1 + 0.0 + (0.3 + 0.0))


def test_the_slowest_site_sets_the_link():
    profile = load_profile("straggler-1gbps-one-site-100mbps")
    assert LinkModel.of(profile, 4).rate_bps == 100e6
    assert LinkModel.of(load_profile("wan-100mbps-40ms-rtt"), 2).rtt_s == pytest.approx(0.040)


def test_accelerator_compute_is_six_n_flops_per_token():
    compute = project.Accelerator(peak_tflops=100, per_site=2, mfu=0.5).compute("tiny", 1000)
    assert compute.step_s == pytest.approx(6 * 875_520 * 1000 / (2 * 100e12 * 0.5))


def test_measured_compute_scales_by_parameters_and_tokens(tmp_path):
    write_run(tmp_path / "runs", "ar", "allreduce", profile="unshaped", tokens_per_s=1000, blocked_share=0.25)
    # 2 sites x 8 x 128 tokens per step at 1000 tokens/s: 2.048 s steps, a quarter of them waiting.
    same = project.resolve_compute("allreduce", {}, "tiny", 2, 2048, [tmp_path / "runs"])
    assert same.step_s == pytest.approx(0.75 * 2.048)
    double = project.resolve_compute("allreduce", {}, "tiny", 2, 4096, [tmp_path / "runs"])
    assert double.step_s == pytest.approx(2 * 0.75 * 2.048)
    with pytest.raises(ProjectionError, match="no successful opendiloco run"):
        project.resolve_compute("opendiloco", {}, "tiny", 2, 2048, [tmp_path / "runs"])


def test_validation_predicts_other_runs_from_unshaped_compute(tmp_path):
    write_run(tmp_path / "compute", "ar", "allreduce", profile="unshaped", tokens_per_s=2000, blocked_share=0.0)
    write_run(tmp_path / "measured", "ar-100", "allreduce", profile="100mbps", tokens_per_s=500, steps=40)
    (row,) = project.validate([tmp_path / "measured"], [tmp_path / "compute"])
    compute_s = 2048 / 2000
    link = LinkModel(100e6, 0.0, window_bytes=link_model.default_window_bytes())
    step_s = compute_s + link.allreduce_s(4 * 875_520, 2)
    assert row["predicted_tokens_per_s"] == pytest.approx(2048 / step_s)
    assert row["measured_tokens_per_s"] == pytest.approx(500)
    assert row["error"] == pytest.approx(2048 / step_s / 500 - 1)
    # From the measured run's own compute (its step less the time it waited), only the link is predicted.
    own_s = 2048 / 500 * (1 - 0.25)
    own_step_s = own_s + link.allreduce_s(4 * 875_520, 2)
    assert row["own_compute_step_s"] == pytest.approx(own_s)
    assert row["own_predicted_tokens_per_s"] == pytest.approx(2048 / own_step_s)
    assert row["own_error"] == pytest.approx(2048 / own_step_s / 500 - 1)
    assert row["link_share"] == pytest.approx(1 - own_s / own_step_s)
    with pytest.raises(ProjectionError, match="no compute measurement for allreduce"):
        project.validate([tmp_path / "measured"], [_opendiloco_only(tmp_path)])


def _opendiloco_only(tmp_path):
    write_run(tmp_path / "od", "od", "opendiloco", profile="unshaped", options={"local_steps": 10})
    return tmp_path / "od"


def test_cli_prints_the_projection_and_writes_json(tmp_path):
    out = CliRunner().invoke(main, [
        "project", "--method", "dilocox", "--model", "opt-1.3b", "--profile", "1gbps", "--clusters", "4",
        "--set", "local_steps=125", "--set", "rank=512", "--accelerator-tflops", "312", "--accelerators-per-site", "8",
        "--mfu", "0.4", "--seq-len", "2048", "--json", str(tmp_path / "p.json"),
    ])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "predicted:" in out.output and "assumptions:" in out.output
    record = json.loads((tmp_path / "p.json").read_text())
    assert record["schedule"]["every_steps"] == 125 and record["predicted_tokens_per_s"] > 0


def test_cli_validation_counts_both_predictions_against_the_tolerance(tmp_path):
    write_run(tmp_path / "compute", "ar", "allreduce", profile="unshaped", tokens_per_s=2000, blocked_share=0.0)
    # Its 4.1 s steps wait 7% (0.29 s) on the link, what 3.5 MB over 100 Mbit/s takes.
    write_run(tmp_path / "measured", "ar-100", "allreduce", profile="100mbps", tokens_per_s=500, steps=40,
              blocked_share=0.07)  # fmt: skip
    out = CliRunner().invoke(main, [
        "project", "--validate", str(tmp_path / "measured"), "--compute-from", str(tmp_path / "compute"),
        "--json", str(tmp_path / "v.json"),
    ])  # fmt: skip
    assert out.exit_code == 0, out.output
    (row,) = json.loads((tmp_path / "v.json").read_text())
    # Compute from the other run is 4x too fast here; the run's own compute leaves only the link to predict.
    assert abs(row["error"]) > 0.15 >= abs(row["own_error"])
    assert "compute from the other runs: 0 of 1 within 15%" in out.output
    assert "each row's own compute: 1 of 1 within 15%" in out.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "say where compute comes from"),
        (["--compute-s", "1", "--compute-from", "."], "say where compute comes from"),
        (["--compute-s", "-1"], "--compute-s must be a positive"),
        (["--accelerator-tflops", "300"], "go together"),
        (["--accelerator-tflops", "300", "--accelerators-per-site", "8", "--mfu", "2"], "--mfu in (0, 1]"),
        (["--compute-s", "1", "--efficiency", "1.5"], "--efficiency must be in (0, 1]"),
        (["--compute-s", "1", "--method", "local"], "not 'local'"),
        (["--compute-s", "1", "--profile", "nope"], "nope"),
        (["--compute-s", "1", "--profile", "straggler-1gbps-one-site-100mbps"], "site 3"),
        (["--compute-s", "1", "--set", "rank=0"], "rank must be at least 1"),
        (["--validate", "."], "--validate needs --compute-from"),
        # Once a ZeroDivisionError; a setting the method ignores, once projected and labelled; a trace, once read
        # as its first row's rate.
        (["--compute-s", "1", "--clusters", "0"], "--clusters must be at least 1, got 0"),
        (["--compute-s", "1", "--set", "reduce_wire=int4"], "reduce_wire applies only with exchange=reduce"),
        (["--compute-s", "1", "--profile", "trace-consumer-uplink"], "replays a trace whose rate changes"),
    ],
)
def test_bad_input_is_one_clear_sentence(args, message):
    out = CliRunner().invoke(main, ["project", *args])
    assert out.exit_code == 2, out.output
    assert message in out.output


def test_gloos_ring_all_reduce_pays_a_round_trip_per_two_segments():
    """gloo cuts the buffer into segments of at most 1 MiB, two in flight: the small model's 43.8 MB of fp32
    gradients are 42 segments, 21 per phase, 11 round trips per phase. (Measured on 100 Mbit/s at 160 ms: 462
    tokens/s, 8.9 s a step, of which 1.8 s compute: 7.1 s for the all-reduce; this gives 3.73 + 22 x 0.16 = 7.25 s.)"""
    nbytes = 4 * 10_943_232
    assert LINK_100M_160MS.allreduce_s(nbytes, 2) == pytest.approx(8 * nbytes / 94e6 + 22 * 0.160)
    # A buffer of at most 2n segments' worth takes the classic 2(n-1) hand-overs.
    assert LINK_100M_160MS.allreduce_s(1000, 8) == pytest.approx(8 * 1750 / 94e6 + 14 * 0.160)
    # All-gathers send each payload whole: one hand-over per ring step.
    assert LINK_100M_160MS.allgather_s(64 << 20, 2) == pytest.approx(8 * (64 << 20) / 94e6 + 0.160)


def test_dilocoxs_rank_estimate_all_reduce_can_outlast_its_payload():
    """Two ring steps for 16 bytes against one for the payload's gather: at 160 ms the estimate sets the time."""
    adaptive = schedule("dilocox", {"local_steps": 10}, "tiny", 2, LINK_100M_160MS)
    fixed = schedule("dilocox", {"local_steps": 10, "adaptive": False}, "tiny", 2, LINK_100M_160MS)
    assert fixed.exchange_s == pytest.approx(LINK_100M_160MS.allgather_s(fixed.payload_bytes, 2))
    assert adaptive.exchange_s == pytest.approx(LINK_100M_160MS.allreduce_s(16, 2))
    assert adaptive.exchange_s > fixed.exchange_s


def test_the_committed_site_validation_recomputes_to_its_table():
    """results/reference/projection-sites-tiny: what docs/studies.md and README print is what its runs give."""
    import pandas as pd

    root = Path(__file__).parents[4] / "results/reference/projection-sites-tiny"
    rows = project.validate(
        [root / "measured", root / "measured-blocking"], [root / "compute", root / "compute-blocking"]
    )
    committed = pd.read_csv(root / "validation.csv")
    assert len(rows) == len(committed) == 12
    for row, (_, saved) in zip(rows, committed.iterrows(), strict=True):
        assert (row["profile"], row["clusters"], row["n"]) == (saved["profile"], saved["clusters"], 3)
        assert row["error"] == pytest.approx(saved["error"]) and row["own_error"] == pytest.approx(saved["own_error"])
        assert abs(row["error"]) <= project.VALIDATION_TOLERANCE >= abs(row["own_error"])
