"""--set: parsing, routing a setting to the run and method it names, each method's documented settings, and
rerunning a recorded run from its config.json."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

import harness.cli as cli
from harness.run.config import RunConfig
from harness.run.settings import (
    SettingError,
    method_settings,
    parse_assignments,
    run_settings,
    settings_from_file,
    settings_markdown,
)
from trainers.registry import method_class, method_names, method_options

ROOT = Path(__file__).resolve().parents[3]
GATE_RUNS = ROOT / "results" / "reference" / "gate" / "runs"


def test_a_run_takes_its_methods_settings_scoped_or_not_and_the_training_settings():
    assert run_settings("dilocox", parse_assignments(["rank=32", "dilocox.overlap=delayed", "steps=5"])) == {
        "rank": 32,
        "overlap": "delayed",
        "steps": 5,
    }
    for texts, message in (
        (["opendiloco.local_steps=10"], "is for opendiloco, and this run is of dilocox"),
        (["rank=16,32"], "gives several values; one run takes one"),
        (["topk_keep=0.1"], "dilocox has no setting 'topk_keep'"),
    ):
        with pytest.raises(SettingError, match=message):
            run_settings("dilocox", parse_assignments(texts))


@pytest.mark.parametrize("method", method_names())
def test_every_setting_is_documented_where_it_is_declared(method):
    old_flags = {"--" + name.replace("_", "-") for name in method_options()}
    for setting in method_settings(method):
        words = setting.help.split()
        assert len(words) >= 4, f"{method}.{setting.name} has no doc (metadata['help'] where it is declared)"
        flags = sorted(old_flags & set(re.findall(r"--[a-z-]+", setting.help)))
        assert not flags, f"{method}.{setting.name}'s doc names {flags}, settings given as --set KEY=VALUE now"


def test_docs_methods_page_holds_every_methods_settings_as_the_configs_declare_them():
    page = (ROOT / "docs" / "methods.md").read_text()
    start, end = "<!-- settings: `harness methods --markdown` writes this part -->\n", "<!-- end of settings -->"
    assert start in page and end in page, "docs/methods.md lost its generated settings section"
    section = page.split(start, 1)[1].split(end, 1)[0]
    assert section == settings_markdown(method_names()), (
        "docs/methods.md's settings differ from the configs: rewrite the part between the markers with "
        "`harness methods --markdown`"
    )


def test_harness_methods_lists_the_methods_and_one_methods_settings():
    listing = CliRunner().invoke(cli.main, ["methods"])
    assert listing.exit_code == 0, listing.output
    for method in method_names():
        assert method in listing.output
    one = CliRunner(env={"COLUMNS": "200"}).invoke(cli.main, ["methods", "dilocox"])
    assert one.exit_code == 0, one.output
    for field in dataclasses.fields(method_class("dilocox").config_class):
        assert field.name in one.output
    unknown = CliRunner().invoke(cli.main, ["methods", "nosuch"])
    assert unknown.exit_code == 2 and "unknown method 'nosuch'" in unknown.output


def test_run_help_lists_the_runs_own_options_each_described():
    command = cli.main.get_command(click.Context(cli.main), "run")
    options = [p for p in command.get_params(click.Context(command)) if isinstance(p, click.Option)]
    assert len(options) <= 30, [o.name for o in options]
    assert [o.name for o in options if not (o.help or "").strip()] == []


def _recorded(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())


@pytest.mark.parametrize("method", ["dilocox", "cocktail", "opendiloco"])
def test_a_recorded_runs_config_builds_that_run_again(method):
    run = next(p for p in sorted(GATE_RUNS.iterdir()) if p.name.startswith(f"{method}-"))
    recorded = _recorded(run)
    given = settings_from_file(run / "config.json")
    rebuilt = json.loads(json.dumps(RunConfig.build(given.method, given.profile, **given.settings).to_dict()))
    assert rebuilt["method"] == method
    # Settings added since the run was recorded take today's defaults; every recorded one is as it was.
    assert {k: rebuilt["train"][k] for k in recorded["train"]} == recorded["train"]
    assert {k: rebuilt["method_options"][k] for k in recorded["method_options"]} == recorded["method_options"]
    assert (rebuilt["clusters"], rebuilt["stages"]) == (recorded["clusters"], recorded["stages"])
    assert settings_from_file(run).settings == given.settings  # the folder reads as its config.json


@pytest.mark.parametrize("method", ["dilocox", "cocktail", "opendiloco", "allreduce"])
def test_a_recorded_runs_settings_pass_the_checks_a_given_setting_meets(method):
    """Recorded options hold every field, some that the others make the method ignore (dilocox's reduce_wire with
    exchange=gather): given back as settings, they were refused ("applies only with exchange=reduce")."""
    from trainers.registry import check_applicable

    run = next(p for p in sorted(GATE_RUNS.iterdir()) if p.name.startswith(f"{method}-"))
    given = settings_from_file(run)
    config = RunConfig.build(given.method, given.profile, **given.settings)
    check_applicable(config.method, config.method_config, config.method_options)
    # What was left out is what the method ignores: the resolved variant is the recorded one.
    recorded = _recorded(run)["method_options"]
    assert {k: config.resolved_options[k] for k in recorded if k in config.resolved_options} == {
        k: v for k, v in recorded.items() if k in config.resolved_options
    }


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"profile": "1gbps"}, "needs at least method: and profile:"),
        ({"method": "allreduce", "profile": "1gbps", "nosuch": 1}, "key(s) no run takes: nosuch"),
        ({"method": "allreduce", "profile": "1gbps", "mode": "calibrate"}, "`harness calibrate` makes those"),
        (
            {"method": "allreduce", "profile": "1gbps", "train": {"optim": {"weight_decay": 0.5}}},
            "sets the optimizer's weight_decay",
        ),
    ],
)
def test_a_config_file_that_describes_no_run_is_refused_by_name(tmp_path, content, message):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(content))
    with pytest.raises(SettingError, match=re.escape(message)):
        settings_from_file(path)


@pytest.mark.parametrize("options", [{}, {"exchange": "reduce"}, {"adaptive": False}])
def test_a_fresh_dilocox_runs_config_reruns_as_that_variant(tmp_path, options):
    """A config.json written today records reduce_wire (and the adaptive bounds) whatever the exchange: --config
    and reproduce refused to rerun every default dilocox run."""
    from trainers.registry import check_applicable

    RunConfig.build("dilocox", "1gbps", steps=20, **options).save(tmp_path / "config.json")
    given = settings_from_file(tmp_path)
    config = RunConfig.build(given.method, given.profile, **given.settings)
    check_applicable(config.method, config.method_config, config.method_options)
    assert config.resolved_options == _recorded(tmp_path)["method_options"]
