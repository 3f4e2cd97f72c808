"""The comparison (harness/analysis/report/aggregates.py): aggregates, their spread and the paired ratios, on run
folders with known (made-up) numbers."""

from __future__ import annotations

import math

import pytest

from harness.analysis.report.aggregates import ReportError, comparison, t_quantile_975
from harness.analysis.report.tables import load_runs
from tests.harness.analysis.report.reporting import row
from tests.harness.fakeruns import write_run


def test_ratios_reductions_utilisation_and_losses(sweep_results):
    table = comparison(load_runs([sweep_results]))
    ar, dl, local = row(table, "allreduce"), row(table, "opendiloco (local_steps=10)"), row(table, "local")
    assert ar["tokens_per_s"] == pytest.approx(1100)
    assert ar["tokens_per_s_std"] == pytest.approx(math.sqrt(2 * 100**2))
    # n = 2: the range, not a standard deviation.
    assert (ar["tokens_per_s_n"], ar["tokens_per_s_low"], ar["tokens_per_s_high"]) == (2, 1000, 1200)
    # allreduce ran seeds 0 and 1 too: the ratio is paired, per seed, then averaged.
    assert dl["ratio_to_allreduce_pairing"] == "paired"
    assert dl["ratio_to_allreduce"] == pytest.approx((5500 / 1000 + 5500 / 1200) / 2)
    assert (dl["ratio_to_allreduce_low"], dl["ratio_to_allreduce_high"]) == pytest.approx((5500 / 1200, 5.5))
    assert ar["ratio_to_allreduce"] == 1.0 and ar["ratio_to_allreduce_pairing"] == "reference"
    assert dl["wire_reduction"] == pytest.approx(100.0)
    # local ran only seed 0: utilisation of a two-seed variant is the ratio of means, without spread.
    assert dl["utilisation_pairing"] == "ratio of means"
    assert dl["utilisation"] == pytest.approx(0.5) and math.isnan(dl["utilisation_low"])
    assert ar["utilisation"] == pytest.approx(0.1)
    assert local["utilisation"] == pytest.approx(1.0)
    assert dl["final_val_loss"] == pytest.approx(4.2)
    assert dl["final_val_loss_std"] == pytest.approx(math.sqrt(0.02))
    assert (ar["seeds"], ar["runs"]) == ("0,1", 2)
    # The fake steps spend 3/4 of their time computing: each run reaches 75% of its own compute ceiling.
    assert ar["compute_utilisation"] == pytest.approx(0.75) and local["compute_utilisation"] == pytest.approx(0.75)


def test_t_quantile_is_the_table_then_its_expansion():
    assert t_quantile_975(2) == 4.3027 and t_quantile_975(60) == pytest.approx(2.0003, abs=1e-4)


def test_only_failed_runs_are_a_clear_error(tmp_path):
    write_run(tmp_path, "broken", failure="rank 0 was killed by SIGKILL")
    with pytest.raises(ReportError, match="no successful runs"):
        comparison(load_runs([tmp_path]))
