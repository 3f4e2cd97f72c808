"""The fault-tolerance section of `harness report`: goodput per failure plan, its share of the failure-free runs
paired by seed, worked out by hand."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from harness.analysis.report.goodput import goodput_markdown, goodput_table


def run(method, seed, plan, goodput, failures=0, heal_s=None, ratio=None, status="ok"):
    return {
        "status": status, "fault_tolerance": "torchft", "profile": "100mbps", "method": method, "steps": 200,
        "seed": seed, "failure_plan": plan, "goodput_tokens_per_s": goodput, "failures": failures, "heal_s": heal_s,
        "heal_bytes_ratio": ratio, "ft_applied_fraction": 1.0, "final_val_loss": 2.8,
    }  # fmt: skip


def test_goodput_is_set_against_the_same_seeds_runs_without_failures():
    runs = pd.DataFrame(
        [
            run("allreduce", 0, "none", 100.0),
            run("allreduce", 1, "none", 200.0),
            run("allreduce", 2, "none", 400.0),
            run("allreduce", 0, "mtbf 60 s", 50.0, failures=2, heal_s=4.0, ratio=1.04),
            run("allreduce", 1, "mtbf 60 s", 150.0, failures=1, heal_s=6.0, ratio=1.05),
            run("allreduce", 2, "mtbf 60 s", 200.0, failures=3, heal_s=5.0, ratio=1.06),
            run("allreduce", 3, "mtbf 60 s", 1.0, status="failed"),
            {**run("local", 0, "none", 9.0), "fault_tolerance": None},
        ]
    )
    table = goodput_table(runs)
    assert list(table["failures_by"]) == ["none", "mtbf 60 s"]
    reference, failing = table.iloc[0], table.iloc[1]
    assert math.isnan(reference["share"].mean)
    # Seed by seed: 50/100, 150/200, 200/400 -> mean 0.5833, the failed run left out.
    assert failing["runs"] == 3
    assert failing["share"].mean == pytest.approx((0.5 + 0.75 + 0.5) / 3)
    assert failing["share"].n == 3 and failing["share"].low < failing["share"].mean < failing["share"].high
    assert failing["goodput"].mean == pytest.approx(400 / 3)
    assert failing["failures"].mean == pytest.approx(2.0) and failing["heal_s"].mean == pytest.approx(5.0)
    assert failing["heal_bytes_ratio"].mean == pytest.approx(1.05)
    text = goodput_markdown(table)
    assert "| allreduce | mtbf 60 s |    3 |" in text and "58.3% ±" in text


def test_no_fault_tolerant_runs_no_section():
    runs = pd.DataFrame([{**run("allreduce", 0, "none", 1.0), "fault_tolerance": None}])
    assert goodput_markdown(goodput_table(runs)) == ""


def test_a_row_on_the_seeds_that_chose_the_settings_is_labelled_in_sample():
    runs = pd.DataFrame(
        [
            {**run("dilocox", seed, plan, 100.0), "in_sample": seed < 2}
            for seed in (0, 1, 2)
            for plan in ("none", "mtbf 40 s")
        ]
    )
    text = goodput_markdown(goodput_table(runs))
    assert "| dilocox (in-sample: seeds 0,1) | mtbf 40 s |" in text
    assert "in-sample: reported on seeds its method's settings were chosen on" in text
    held_out = goodput_markdown(goodput_table(runs.assign(in_sample=False)))
    assert "in-sample" not in held_out
