"""The speed-up-vs-target curve's arithmetic on fixed loss trajectories (harness/analysis/report/target_curve.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd
import pytest

from harness.analysis.report.target_curve import speedup_curve, speedup_curve_figures, target_grid

TOKENS = (100, 200, 300, 400)


def _curves(variant: str, losses: tuple, seconds: tuple, seeds=(0, 1)) -> list[dict]:
    return [
        {"profile": "1gbps", "how": "measured", "variant": variant, "method": variant.split()[0], "seed": seed,
         "tokens": t, "val_loss": loss, "elapsed_s": s}
        for seed in seeds
        for t, loss, s in zip(TOKENS, losses, seconds, strict=True)
    ]  # fmt: skip


def test_the_grid_runs_from_allreduces_loss_at_a_quarter_of_its_tokens_to_its_final_loss():
    curves = pd.DataFrame(_curves("allreduce", (4.0, 3.0, 2.0, 1.0), (1, 2, 3, 4)))
    # A quarter of 400 tokens is the first evaluation (loss 4); the final loss is 1.
    assert list(target_grid(curves, 4)) == pytest.approx([4.0, 3.0, 2.0, 1.0])
    # Interpolated between evaluations: a quarter of 400 tokens falls halfway between those at 50 and 150.
    uneven = curves.assign(tokens=[50, 150, 250, 400] * 2)
    assert target_grid(uneven, 2)[0] == pytest.approx(3.5)


def test_each_variants_speed_up_is_allreduces_time_over_its_own_paired_per_seed(tmp_path):
    rows = [
        *_curves("allreduce", (4.0, 3.0, 2.0, 1.0), (1, 2, 3, 4)),
        *_curves("fast", (4.0, 3.0, 2.0, 1.0), (0.5, 1.0, 1.5, 2.0)),  # the same losses in half the time
        *_curves("loose", (4.0, 3.5, 3.0, 2.5), (1, 2, 3, 4)),  # reaches 3.0 a step later, 2.0 never
    ]
    curve = speedup_curve(
        SimpleNamespace(curves=pd.DataFrame(rows), spec=SimpleNamespace(composed_methods={})), points=4
    )
    at = curve.set_index(["variant", "target_loss"])
    for target in (4.0, 3.0, 2.0, 1.0):
        assert at.loc[("fast", target), "speedup"] == pytest.approx(2.0)
        assert at.loc[("allreduce", target), "speedup"] == pytest.approx(1.0)
    assert at.loc[("loose", 4.0), "speedup"] == pytest.approx(1.0)
    assert at.loc[("loose", 3.0), "speedup"] == pytest.approx(2 / 3)  # 3 s against AllReduce's 2 s
    assert at.loc[("loose", 3.0), "speedup_pairing"] == "paired" and at.loc[("loose", 3.0), "reached"] == 2
    assert math.isnan(at.loc[("loose", 2.0), "speedup"]) and at.loc[("loose", 2.0), "reached"] == 0
    paths = speedup_curve_figures(curve, 3.0, tmp_path)
    assert {p.name for p in paths} == {"speedup-vs-target-1gbps-measured.png", "speedup-vs-target-1gbps-measured.svg"}
