"""Variants keyed on every option a run ran with, defaults included (harness/analysis/options.py): what runs record,
how the tables name them, and how a folder that recorded only its given options is read and marked."""

from __future__ import annotations

import json

from harness.analysis.options import AS_GIVEN, unique_labels
from harness.analysis.report.aggregates import comparison
from harness.analysis.report.results import report_markdown
from harness.analysis.report.tables import load_runs
from harness.run.config import RunConfig
from tests.harness.fakeruns import write_run
from trainers.methods.dilocox import DiLoCoXConfig
from trainers.registry import options_shown, resolved_options


def _by_name(runs):
    return runs.set_index(runs["path"].str.rsplit("/", n=1).str[-1])


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _rewrite_summary(run_dir, **changes) -> None:
    summary = {**_summary(run_dir), **changes}
    (run_dir / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if v is not None}))


def _as_older_harness_wrote_it(run_dir, commit: str) -> None:
    """summary.json and config.json as a harness before resolved options wrote them: only the options given."""
    summary = _summary(run_dir)
    _rewrite_summary(run_dir, method_options=summary["method_options_given"], method_options_given=None)
    config = json.loads((run_dir / "config.json").read_text())
    config["method_options"] = config.pop("method_options_given")
    (run_dir / "config.json").write_text(json.dumps(config))
    (run_dir / "environment.json").write_text(json.dumps({"git_commit": commit}))


def test_a_run_records_every_option_and_those_given(tmp_path):
    run_dir = write_run(tmp_path, "dx", "dilocox", options={"rank": 32})
    summary, config = _summary(run_dir), json.loads((run_dir / "config.json").read_text())
    every = resolved_options("dilocox", {"rank": 32})
    assert set(every) == set(DiLoCoXConfig.__dataclass_fields__) and every["local_steps"] == DiLoCoXConfig.local_steps
    # Derived defaults are recorded as they were resolved: tau from H.
    assert every["overlap_steps"] == DiLoCoXConfig.local_steps // 10
    assert summary["method_options"] == config["method_options"] == every
    assert summary["method_options_given"] == config["method_options_given"] == {"rank": 32}
    # The config's input is what was given: a rerun from config.json resolves today's defaults the same way.
    assert RunConfig.load(run_dir / "config.json").method_options == {"rank": 32}


def test_the_same_options_are_one_variant_named_by_what_differs_from_the_defaults(tmp_path):
    write_run(tmp_path, "default", "dilocox")
    write_run(tmp_path, "default-given", "dilocox", seed=1, options={"local_steps": DiLoCoXConfig.local_steps})
    write_run(tmp_path, "rank32", "dilocox", options={"rank": 32})
    # A cocktail run given --bits none: None is an option's value, not "unset".
    write_run(tmp_path, "fp32", "cocktail", options={"bits": "none"})
    runs = _by_name(load_runs([tmp_path]).runs)
    assert runs.loc["default", "variant"] == runs.loc["default-given", "variant"] == "dilocox"
    assert runs.loc["default", "variant_key"] == runs.loc["default-given", "variant_key"]
    assert runs.loc["rank32", "variant"] == "dilocox (rank=32)"
    assert runs.loc["fp32", "variant"] == "cocktail (bits=None)"
    assert runs["options_recorded"].all()


def test_a_run_made_before_a_default_changed_is_its_own_variant(tmp_path):
    """Its resolved options say what it ran; today's defaults name it by the difference."""
    write_run(tmp_path, "today", "dilocox")
    before = write_run(tmp_path, "before", "dilocox", seed=1)
    _rewrite_summary(before, method_options={**_summary(before)["method_options"], "outer_lr": 0.5})
    runs = _by_name(load_runs([tmp_path]).runs)
    assert runs.loc["before", "variant"] == "dilocox (outer_lr=0.5)" and runs.loc["today", "variant"] == "dilocox"


def test_a_run_made_before_a_setting_existed_reads_it_as_what_it_ran(tmp_path):
    """DiLoCoX's exchange and reduce_wire came after the gate's reference runs, which then read exchange=None and
    could not be checked again: a setting added later reads as the value every earlier run had."""
    write_run(tmp_path, "today", "dilocox")
    before = write_run(tmp_path, "before", "dilocox", seed=1)
    recorded = {k: v for k, v in _summary(before)["method_options"].items() if k not in ("exchange", "reduce_wire")}
    _rewrite_summary(before, method_options=recorded)
    runs = _by_name(load_runs([tmp_path]).runs)
    assert runs.loc["before", "variant_key"] == runs.loc["today", "variant_key"]
    assert runs.loc["before", "variant"] == "dilocox"
    # A run that recorded another value keeps it.
    _rewrite_summary(before, method_options={**recorded, "exchange": "reduce"})
    runs = _by_name(load_runs([tmp_path]).runs)
    assert runs.loc["before", "variant"] == "dilocox (exchange=reduce)"


def test_a_folder_that_recorded_only_its_given_options_is_marked_kept_apart_and_noted(tmp_path):
    write_run(tmp_path, "new", "dilocox", options={"rank": 32})
    _as_older_harness_wrote_it(
        write_run(tmp_path, "old", "dilocox", seed=1, options={"rank": 32}), "abc1234" + "0" * 33
    )
    tables = load_runs([tmp_path])
    runs = _by_name(tables.runs)
    # Read as its given options over today's defaults, and marked so: never pooled with a run that recorded them.
    assert runs.loc["old", "variant"] == f"dilocox (rank=32) {AS_GIVEN}"
    assert json.loads(runs.loc["old", "options"]) == resolved_options("dilocox", {"rank": 32})
    assert not runs.loc["old", "options_recorded"] and runs.loc["old", "options_commit"].startswith("abc1234")
    assert runs.loc["new", "variant"] == "dilocox (rank=32)"
    text = report_markdown(comparison(tables), tables.runs)
    assert f"1 run marked {AS_GIVEN} recorded only the options given" in text and "commit abc1234" in text


def test_labels_that_two_variants_share_get_their_key_digest():
    labels = unique_labels({"a": "dilocox", "b": "dilocox", "c": "local"})
    assert labels["c"] == "local" and labels["a"] != labels["b"] and labels["a"].startswith("dilocox #")


def test_the_label_shows_the_fewest_options_that_give_the_resolved_ones():
    # overlap_steps follows local_steps: shown only where it was set apart from it.
    assert options_shown("dilocox", resolved_options("dilocox", {"local_steps": 40})) == {"local_steps": 40}
    both = resolved_options("dilocox", {"local_steps": 40, "overlap_steps": 1})
    assert options_shown("dilocox", both) == {"local_steps": 40, "overlap_steps": 1}
    assert options_shown("dilocox", resolved_options("dilocox")) == {}
