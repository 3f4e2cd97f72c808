"""Every command the repository stores (a study's sweep.json and compare.json, the baseline's regeneration command)
still parses and validates with today's CLI: a stored command is how a reader regenerates a result, so a change to
the CLI that breaks one must migrate it in the same commit."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

import harness.cli as cli
import harness.cli.compare as compare_cli
import harness.cli.sweep as sweep_cli

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "results" / "reference"


class Validated(Exception):
    """Raised where the command would start its runs: everything before it (parsing, every check) passed."""


def _baseline_commands() -> list[str]:
    lines = (REFERENCE / "baseline.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("with:")) + 2
    end = lines.index("#", start)
    joined = " ".join(line.lstrip("#").strip().removesuffix("\\").strip() for line in lines[start:end])
    return [c for c in joined.split(" && ") if c.startswith("harness sweep")]


def stored_commands() -> list[tuple[str, str]]:
    found = []
    for record in sorted([*REFERENCE.rglob("sweep.json"), *REFERENCE.rglob("compare.json")]):
        command = json.loads(record.read_text()).get("command")
        if command:
            found.append((str(record.relative_to(ROOT)), command))
    found += [("results/reference/baseline.yaml", command) for command in _baseline_commands()]
    return found


def test_the_repository_stores_commands_of_every_kind():
    kinds = {shlex.split(command)[1] for _, command in stored_commands()}
    assert {"sweep", "compare"} <= kinds
    assert len(stored_commands()) >= 30


@pytest.mark.parametrize(("where", "command"), stored_commands(), ids=lambda v: v if "/" in v else None)
def test_a_stored_command_runs_with_todays_cli(where, command, monkeypatch):
    def stop():
        raise Validated

    monkeypatch.setattr(sweep_cli, "reexec_if_unprivileged", stop)
    monkeypatch.setattr(compare_cli, "reexec_if_unprivileged", stop)
    monkeypatch.chdir(ROOT)
    words = shlex.split(command)
    assert words[0] == "harness"
    result = CliRunner().invoke(cli.main, words[1:])
    assert isinstance(result.exception, Validated), f"{where}: {command}\n{result.output}"


# The hostile round gives the CLI refused flags on purpose: that they are refused is what it checks.
GIVES_REFUSED_FLAGS = {ROOT / "scripts" / "hostile-inputs.py"}


def _documents() -> list[Path]:
    shown = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "scripts").iterdir()]
    return sorted(p for p in shown + list(REFERENCE.rglob("README.md")) if p not in GIVES_REFUSED_FLAGS)


@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_script_or_page_shows_a_flag_the_cli_refuses(path):
    """Scripts and docs show commands in shell form (variables, line breaks) that the test above cannot run; every
    flag in them must still be one the CLI takes, not a method flag of before --set."""
    from harness.run.settings import old_flag_message

    refused = sorted(
        {flag for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", path.read_text()) if old_flag_message(flag)}
    )
    assert refused == [], f"{path.relative_to(ROOT)} shows {refused}; write them as --set KEY=VALUE"
