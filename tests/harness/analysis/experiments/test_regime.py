"""Regime matching: the derived link, corrected closed-loop against measurement."""

from __future__ import annotations

from harness.analysis.experiments.regime import closed_loop
from harness.analysis.projection.regime import TARGETS, Probe, Regime


def test_the_closed_loop_corrects_the_rate_until_the_achieved_r_is_within_ten_percent():
    """T_comm ~ 1 / rate plus a fixed cost the open-loop derivation leaves out: the loop measures and corrects."""
    regime = Regime(TARGETS["paper-107b"], "tiny", 2, 1_000_000, compute_s=0.01, tokens_per_step=256)
    target_r = TARGETS["paper-107b"].comm_to_compute
    seen = []

    def measure(rate_bps: int, index: int) -> Probe:
        seen.append(rate_bps)
        comm_s = 8 * regime.payload_bytes / (0.84 * rate_bps) + 0.2  # 84% of the rate, plus 200 ms per step
        return Probe(rate_bps, 256 / 0.01, 256 / (0.01 + comm_s))

    told: list[str] = []
    matched = closed_loop(regime, measure, told.append)
    assert seen[0] == regime.open_loop_rate_bps and len(seen) >= 2
    assert abs(matched.achieved_r / target_r - 1) <= 0.10 and matched.converged
    assert matched.rate_bps == seen[-1] > regime.open_loop_rate_bps
    record = matched.record()
    assert record["target_r"] == target_r and record["achieved_r"] == matched.achieved_r
    assert [p["rate_bps"] for p in record["probes"]] == seen
    # Each probe is announced before it runs (minutes each on a slow link) and its R told after.
    assert len(told) == 2 * len(seen) and told[0].startswith("probe 1 of at most 4: 30 local and 6 allreduce steps")
    assert told[-1] == f"probe {len(seen)}: achieved R {matched.achieved_r:.1f}, target {target_r:.1f}"
