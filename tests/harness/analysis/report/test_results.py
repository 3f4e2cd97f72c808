"""The report (harness/analysis/report/results.py, files.py): the comparison as markdown, its files, and
`harness report`, on run folders with known (made-up) numbers."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pandas as pd
import pytest
from click.testing import CliRunner

from harness.analysis.report import files
from harness.analysis.report.aggregates import ReportError, comparison, site_comparison, t_quantile_975
from harness.analysis.report.results import report_markdown
from harness.analysis.report.tables import load_runs
from harness.cli import main
from tests.harness.analysis.report.reporting import cells_of, row
from tests.harness.fakeruns import damage, write_run


def test_interval_of_three_runs_is_the_student_t_one(tmp_path):
    speeds = (1000.0, 1100.0, 1300.0)
    for seed, speed in enumerate(speeds):
        write_run(tmp_path, f"ar-s{seed}", "allreduce", seed=seed, tokens_per_s=speed)
        write_run(tmp_path, f"dl-s{seed}", "opendiloco", seed=seed, tokens_per_s=5000, options={"local_steps": 5})
    tables = load_runs([tmp_path])
    table = comparison(tables)
    ar = row(table, "allreduce")
    # By hand: mean 1133.33, sample std sqrt((133.33^2 + 33.33^2 + 166.67^2) / 2) = 152.75, t_{0.975,2} = 4.3027.
    half = 4.3027 * 152.7525 / math.sqrt(3)
    assert ar["tokens_per_s_n"] == 3
    assert ar["tokens_per_s"] == pytest.approx(1133.333, abs=1e-3)
    assert (ar["tokens_per_s_low"], ar["tokens_per_s_high"]) == pytest.approx((1133.333 - half, 1133.333 + half))
    # Paired ratio: per seed 5, 4.545, 3.846; mean 4.464, sample std 0.5812.
    dl = row(table, "opendiloco (local_steps=5)")
    ratios = [5000 / s for s in speeds]
    mean = sum(ratios) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in ratios) / 2)
    assert dl["ratio_to_allreduce_pairing"] == "paired" and dl["ratio_to_allreduce_n"] == 3
    assert dl["ratio_to_allreduce"] == pytest.approx(mean) == pytest.approx(4.4639, abs=1e-4)
    assert std == pytest.approx(0.5812, abs=1e-4)
    assert dl["ratio_to_allreduce_high"] - mean == pytest.approx(4.3027 * std / math.sqrt(3))
    cells = cells_of(report_markdown(table, tables.runs), "allreduce")
    assert cells[1] == "3" and cells[3] == f"1,133 ± {half:,.0f}" == "1,133 ± 379"
    assert cells_of(report_markdown(table, tables.runs), "opendiloco")[4] == "4.46x ± 1.4 (paired)"


def test_one_run_says_it_has_no_spread(tmp_path):
    write_run(tmp_path, "ar", "allreduce", tokens_per_s=1000, val_losses=(5.5, 4.5, 4.0))
    write_run(tmp_path, "dl", "opendiloco", tokens_per_s=4000, options={"local_steps": 5})
    tables = load_runs([tmp_path])
    table = comparison(tables)
    assert row(table, "allreduce")["tokens_per_s_n"] == 1
    assert math.isnan(row(table, "allreduce")["tokens_per_s_low"])
    cells = cells_of(report_markdown(table, tables.runs), "opendiloco")
    assert cells[1:5] == ["1", "0", "4,000 (n=1, no spread)", "4x (n=1, no spread, paired)"]
    assert cells[6] == "75% (n=1, no spread)" and cells[9] == "4.000 (n=1, no spread)"
    assert "± " not in cells_of(report_markdown(table, tables.runs), "allreduce")[3]


def test_applied_and_trained_throughput_and_few_syncs_are_shown(tmp_path):
    write_run(tmp_path, "ar", "allreduce", tokens_per_s=1000)
    # 20 steps, 5 of warm-up, the last 5 not in the final model: 10 of the window's 15 steps applied.
    write_run(tmp_path, "dl", "opendiloco", tokens_per_s=6000, sync_every=10, applied_steps=15,
              options={"local_steps": 10})  # fmt: skip
    tables = load_runs([tmp_path])
    table = comparison(tables)
    dl = row(table, "opendiloco (local_steps=10)")
    assert dl["tokens_per_s"] == pytest.approx(4000) and dl["trained_tokens_per_s"] == pytest.approx(6000)
    assert dl["sync_count_min"] == 2 and dl["few_syncs"] and not row(table, "allreduce")["few_syncs"]
    text = report_markdown(table, tables.runs)
    header = next(x for x in text.splitlines() if x.startswith("| method"))
    assert "| applied tokens/s | trained tokens/s |" in " ".join(header.split())
    cells = cells_of(text, "opendiloco")
    assert cells[0] == "opendiloco (local_steps=10) ⚠ 2 syncs"
    assert cells[3:5] == ["4,000 (n=1, no spread)", "6,000 (n=1, no spread)"]
    assert "⚠: its runs crossed the slow link fewer than 3 times" in text
    # Where applied and trained agree, there is no trained column.
    only_ar = load_runs([tmp_path / "ar"])
    assert "trained tokens/s" not in report_markdown(comparison(only_ar), only_ar.runs)


def test_default_target_is_halfway_between_allreduce_worst_and_local_best(sweep_results):
    table = comparison(load_runs([sweep_results]))
    ar, dl, local = row(table, "allreduce"), row(table, "opendiloco (local_steps=10)"), row(table, "local")
    # allreduce ends at 4.0 and 3.8 (worst 4.0); local's lowest evaluation is 4.9: halfway, 4.45.
    assert ar["target_loss"] == pytest.approx(4.45) and ar["target_source"] == "allreduce"
    # allreduce gets below 4.45 at step 10 on both seeds (4.4 and 4.2) ...
    assert ar["reached"] == 2
    assert ar["tokens_to_target"] == pytest.approx(10 * 2048)
    assert ar["time_to_target_s"] == pytest.approx((10 * 2048 / 1000 + 10 * 2048 / 1200) / 2)
    # ... opendiloco at step 20 (4.1 and 4.3), local never (it set the bound).
    assert dl["reached"] == 2 and dl["tokens_to_target"] == pytest.approx(20 * 2048) and local["reached"] == 0
    tables = load_runs([sweep_results])
    text = report_markdown(comparison(tables), tables.runs)
    assert "Target validation loss: 4.450 (halfway between allreduce's highest final validation loss over its " in text
    assert "(4.9: no local run reaches it)" in text


def test_default_target_without_local_is_allreduce_mean_plus_five_percent(sweep_results):
    (sweep_results / "runs" / "local-s0").rename(sweep_results / "local-elsewhere")
    tables = load_runs([sweep_results / "runs"])
    ar = row(comparison(tables), "allreduce")
    assert ar["target_loss"] == pytest.approx(3.9 * 1.05)
    assert "x 1.05; no local run to check it against" in report_markdown(comparison(tables), tables.runs)


def test_default_target_where_local_reaches_allreduce_is_its_worst_final(tmp_path):
    write_run(tmp_path, "ar-s0", "allreduce", seed=0, val_losses=(5.5, 4.4, 4.0))
    write_run(tmp_path, "ar-s1", "allreduce", seed=1, val_losses=(5.5, 4.2, 3.8))
    write_run(tmp_path, "local-s0", "local", seed=0, val_losses=(5.5, 3.9, 4.2))
    table = comparison(load_runs([tmp_path]))
    assert row(table, "allreduce")["target_loss"] == pytest.approx(4.0)
    assert row(table, "local")["reached"] == 1
    assert "local reached 3.9, below it" in row(table, "allreduce")["target_rule"]


def test_given_target_and_groups_without_allreduce(sweep_results):
    write_run(sweep_results / "runs", "dl-100", "opendiloco", profile="100mbps", tokens_per_s=300,
              options={"local_steps": 10})  # fmt: skip
    (sweep_results / "runs" / "ar-100").rename(sweep_results / "ar-100-elsewhere")  # 100mbps now has no allreduce run
    tables = load_runs([sweep_results / "runs"])
    table = comparison(tables, target_loss=4.0)
    assert set(table["target_loss"]) == {4.0}
    assert row(table, "allreduce")["reached"] == 2
    assert row(table, "opendiloco (local_steps=10)")["reached"] == 0
    assert row(table, "opendiloco (local_steps=10)", "100mbps")["reached"] == 1
    assert "Target validation loss: 4.000 (--target-loss)." in report_markdown(table, tables.runs)
    # Without --target-loss the group without allreduce has no target: one line, no target columns.
    table = comparison(tables)
    slow = row(table, "opendiloco (local_steps=10)", "100mbps")
    assert math.isnan(slow["target_loss"]) and math.isnan(slow["ratio_to_allreduce"])
    assert math.isnan(slow["utilisation"])
    text = report_markdown(table, tables.runs)
    section = text[text.index("### 100mbps") : text.index("### 1gbps")]
    assert "Tokens and time to target: not computed (no allreduce run in this group" in section
    assert "tokens to target" not in section and "tokens to target" in text[text.index("### 1gbps") :]


def test_markdown_shows_the_comparison_and_the_failures(sweep_results):
    tables = load_runs([sweep_results])
    text = report_markdown(comparison(tables), tables.runs)
    assert "### 1gbps (1 Gbit/s) · model tiny" in text and "### 100mbps (100 Mbit/s)" in text
    assert "n: runs aggregated" in text
    cells = cells_of(text, "opendiloco (local_steps=10)")
    # Loss vs allreduce, paired per seed: 4.1 / 4.0 and 4.3 / 3.8; the target (4.45) reached at step 20 of 2,048 tokens.
    assert cells[1:12] == [
        "2", "0,1", "5,500 (range 5,500–5,500)", "5.04x (range 4.58x–5.5x, paired)", "50% (ratio of means)",
        "75% (range 75%–75%)", "4.0", "100x", "4.200 (range 4.100–4.300)", "+7.83% (range +2.5%–+13.2%, paired)",
        "40,960",
    ]  # fmt: skip
    assert cells_of(text, "allreduce")[4:6] == ["1x", "10% (ratio of means)"]
    assert "1 failed run(s)" in text and "sweep/runs/broken: rank 1 exited with code 1" in text


def test_parquet_without_an_engine_says_so(sweep_results, tmp_path, monkeypatch):
    monkeypatch.setattr(files, "parquet_engine", lambda: None)
    with pytest.raises(ReportError, match="parquet needs pyarrow or fastparquet"):
        files.write_parquet(comparison(load_runs([sweep_results])), tmp_path / "x.parquet")


def test_cli_prints_markdown_and_writes_tables(sweep_results, tmp_path, monkeypatch):
    monkeypatch.setattr(files, "parquet_engine", lambda: None)
    out = CliRunner().invoke(
        main, ["report", str(sweep_results), "--csv", str(tmp_path / "c.csv"), "--tables", str(tmp_path / "t")]
    )
    assert out.exit_code == 0, out.output
    assert "| allreduce" in out.output
    compared = pd.read_csv(tmp_path / "c.csv")
    assert len(compared) == 4
    assert {"tokens_per_s_n", "tokens_per_s_low", "ratio_to_allreduce_pairing", "compute_utilisation"} <= set(compared)
    runs = pd.read_csv(tmp_path / "t" / "runs.csv")
    assert len(runs) == 7 and {"compute_utilisation", "compute_ceiling_tokens_per_s"} <= set(runs)
    given = CliRunner().invoke(main, ["report", str(sweep_results), "--target-loss", "4.25"])
    assert given.exit_code == 0 and "Target validation loss: 4.250 (--target-loss)." in given.output
    assert (tmp_path / "t" / "events.csv").is_file()
    failed = CliRunner().invoke(main, ["report", str(sweep_results), "--parquet", str(tmp_path / "c.parquet")])
    assert failed.exit_code == 2 and "neither is installed" in failed.output


def test_a_regime_matched_group_shows_the_ratio_normalized_to_the_target(tmp_path):
    """(1 + R_target) x utilisation: the ratio at exactly the target's R, next to the raw one."""
    import json

    for seed in (0, 1, 2):
        for method, tokens_per_s in (("allreduce", 50.0), ("dilocox", 9_000.0), ("local", 18_000.0)):
            out = write_run(tmp_path, f"{method}-s{seed}", method, seed=seed, tokens_per_s=tokens_per_s)
            summary = json.loads((out / "summary.json").read_text())
            summary["regime_target_r"] = 357.5
            (out / "summary.json").write_text(json.dumps(summary))
    tables = load_runs([tmp_path])
    table = comparison(tables)
    dilocox = table[table["method"] == "dilocox"].iloc[0]
    assert dilocox["normalized_ratio"] == pytest.approx(358.5 * 0.5)
    text = report_markdown(table, tables.runs)
    assert "(1 + 357.5) x utilisation" in text and "179x" in text and "358.5x (by definition)" in text


def _straggler_runs(root, method: str, waits_by_seed: dict[int, list[float]]) -> None:
    """4-site runs on the straggler profile whose per-site waiting times are set by the test."""
    import json

    for seed, waits in waits_by_seed.items():
        run = write_run(root, f"{method}-s{seed}", method, profile="straggler-1gbps-one-site-100mbps", seed=seed,
                        options={"clusters": 4})  # fmt: skip
        summary = json.loads((run / "summary.json").read_text())
        for site, waited in zip(summary["per_cluster"], waits, strict=True):
            site["comm_blocked_s"] = waited
        (run / "summary.json").write_text(json.dumps(summary))


def test_per_site_table_for_uneven_sites_only(sweep_results, tmp_path):
    root = tmp_path / "straggler"
    _straggler_runs(root, "allreduce", {0: [3.0, 3.0, 3.0, 1.0], 1: [5.0, 5.0, 5.0, 1.0], 2: [4.0, 4.0, 4.0, 1.0]})
    tables = load_runs([root, sweep_results])
    sites = site_comparison(tables)
    # The 2-site groups on one rate (the `sweep_results` fixture) have no per-site rows.
    assert set(sites["profile"]) == {"straggler-1gbps-one-site-100mbps"}
    assert sites["cluster"].tolist() == [0, 1, 2, 3]
    assert sites["uplink_rate_bps"].tolist() == [1e9, 1e9, 1e9, 1e8]
    site0 = sites.iloc[0]
    assert site0["waited_s"] == pytest.approx(4.0) and site0["waited_s_n"] == 3
    half = t_quantile_975(2) * 1.0 / math.sqrt(3)  # values 3, 5, 4: sample std 1
    assert (site0["waited_s_low"], site0["waited_s_high"]) == pytest.approx((4.0 - half, 4.0 + half))
    text = report_markdown(comparison(tables), tables.runs, sites)
    section = text[text.index("### straggler-1gbps-one-site-100mbps") :]
    assert "Per site:" in section and "Per site:" not in text[: text.index("### straggler")]
    per_site = section[section.index("Per site:") :]
    line = next(x for x in per_site.splitlines() if x.startswith("| allreduce") and "| 3 " in x)
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    assert cells[2] == "100 Mbit/s" and cells[4] == "1.00 s ± 0.00"
    out = CliRunner().invoke(main, ["report", str(root), "--tables", str(tmp_path / "t")])
    assert out.exit_code == 0 and "Per site:" in out.output, out.output
    assert len(pd.read_csv(tmp_path / "t" / "sites.csv")) == 12


def _harness(*args: object) -> subprocess.CompletedProcess:
    """The installed command line, as a user runs it: its exit status and its two streams."""
    command = [sys.executable, "-m", "harness.cli", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_cli_names_an_unreadable_run_folder_in_one_line(sweep_results):
    bad = sweep_results / "runs" / "ar-s0" / "summary.json"
    why = damage(bad, "list-shaped")
    out = _harness("report", bad.parent)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.splitlines() == [f"error: {bad}: {why}; run it again (resuming its sweep redoes it) or remove "
                                       "its run folder"]  # fmt: skip


def test_cli_reports_the_readable_runs_and_exits_1_naming_the_unreadable_one(sweep_results):
    bad = sweep_results / "runs" / "dl-s1" / "summary.json"
    why = damage(bad, "truncated")
    out = _harness("report", sweep_results)
    assert "| allreduce" in out.stdout and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1].startswith(f"skipped 1 unreadable run: {bad}: {why}")
    assert out.returncode == 1


def test_runs_under_different_tokenizers_are_not_one_group(tmp_path):
    """A loss per token compares only under one tokenizer; a run from before --tokenizer counts as bytes."""
    write_run(tmp_path, "ar-bytes", "allreduce", val_losses=(5.5, 4.5, 4.0))
    bpe = write_run(tmp_path, "ar-bpe", "allreduce", val_losses=(8.0, 7.0, 6.0))
    summary = json.loads((bpe / "summary.json").read_text())
    (bpe / "summary.json").write_text(json.dumps({**summary, "tokenizer": "bpe:4096"}))
    tables = load_runs([tmp_path])
    table = comparison(tables)
    assert sorted(table["tokenizer"]) == ["bpe:4096", "bytes"]
    assert list(table["final_val_loss_n"]) == [1, 1]
    text = report_markdown(table, tables.runs)
    assert text.count("### ") == 2 and "· 20 steps · tokenizer bpe:4096\n" in text and "· 20 steps\n" in text


def _sweep(root, selected_on, seeds=(0, 1, 2, 3)):
    """A sweep folder (sweep.json + runs/) of allreduce and dilocox on `seeds`."""
    (root / "runs").mkdir(parents=True)
    record = {"settings": {}, "command": "harness sweep ...", **({"selected_on": selected_on} if selected_on else {})}
    (root / "sweep.json").write_text(json.dumps(record))
    for seed in seeds:
        write_run(root / "runs", f"allreduce-s{seed}", "allreduce", seed=seed)
        write_run(root / "runs", f"dilocox-s{seed}", "dilocox", seed=seed, tokens_per_s=3000)


def test_a_row_on_the_seeds_that_chose_its_settings_is_labelled_in_sample(tmp_path):
    """sweep.json's selected_on (harness sweep --selected-on) marks the runs on those seeds; the label names them."""
    _sweep(tmp_path / "study", {"dilocox": [1, 2, 7]})
    table = comparison(load_runs([tmp_path / "study"]))
    by_method = table.set_index("method")["in_sample_seeds"]
    assert by_method["dilocox"] == "1,2" and by_method["allreduce"] == ""
    text = report_markdown(table, load_runs([tmp_path / "study"]).runs)
    assert "| dilocox (in-sample: seeds 1,2) |" in text and "| allreduce   " in text and "allreduce (in" not in text
    assert "in-sample: reported on seeds its method's settings were chosen on" in text


def test_without_selected_on_or_on_other_seeds_nothing_is_labelled(tmp_path):
    _sweep(tmp_path / "old", None)  # a sweep from before --selected-on
    _sweep(tmp_path / "held-out", {"dilocox": [0, 1, 2, 3]}, seeds=(10, 11, 12))
    for study in ("old", "held-out"):
        table = comparison(load_runs([tmp_path / study]))
        assert not table["in_sample_seeds"].astype(bool).any()
        assert "in-sample" not in report_markdown(table, load_runs([tmp_path / study]).runs)


def test_a_damaged_sweep_record_skips_its_runs_naming_it(tmp_path):
    _sweep(tmp_path / "study", {"dilocox": [1]})
    write_run(tmp_path, "alone", "allreduce")
    (tmp_path / "study" / "sweep.json").write_text('{"selected_on": ')
    tables = load_runs([tmp_path])
    assert [path.rpartition("/")[2] for path in tables.runs["path"]] == ["alone"]
    assert {str(s.path) for s in tables.skipped} == {str(tmp_path / "study" / "sweep.json")}
