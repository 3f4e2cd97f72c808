"""The gate's measures of one run (harness/analysis/gate/measures.py) against the link model's prediction worked out
by hand, not taken from the model itself."""

from __future__ import annotations

import pytest

from harness.analysis.gate.measures import measure
from harness.run.folder import read_summary
from tests.harness.fakeruns import write_run

STEPS, WARMUP = 40, 5
COMPUTE_S, OWN_S = 0.070, 0.077  # forward and backward; the whole step's own work (overhead 1.1)
# AllReduce of the tiny model on 100 Mbit/s, no delay, between two sites: the ring sends 2(n-1)/n = 1 x its 3,502,080
# fp32 bytes at 94% of the rate (TCP/IP's framing), and a zero round trip adds nothing.
LINK_S = 8 * 3_502_080 / 94e6  # 0.29805 s


def _allreduce_run(tmp_path, link_s: float):
    """An allreduce run whose every step is OWN_S of its own work and link_s waiting on the link."""
    step_s = OWN_S + link_s
    run_dir = write_run(
        tmp_path, f"ar-{link_s:.4f}", "allreduce", profile="100mbps", tokens_per_s=2 * 8 * 128 / step_s,
        steps=STEPS, blocked_share=link_s / step_s, compute_s=COMPUTE_S,
    )  # fmt: skip
    return measure(run_dir, read_summary(run_dir))


@pytest.mark.parametrize("slower", [1.0, 1.2, 0.9])
def test_the_residual_is_the_window_over_the_link_models_by_hand(tmp_path, slower):
    """Each of the 35 steps after warm-up predicted at OWN_S + LINK_S: a link `slower` times the prediction reads
    (OWN_S + slower x LINK_S) / (OWN_S + LINK_S)."""
    measured = _allreduce_run(tmp_path, slower * LINK_S)
    assert measured["step_time_residual"] == pytest.approx((OWN_S + slower * LINK_S) / (OWN_S + LINK_S), rel=1e-6)
    assert measured["step_overhead"] == pytest.approx(OWN_S / COMPUTE_S)
