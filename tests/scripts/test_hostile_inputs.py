"""scripts/hostile-inputs.py's catalogue: large enough, each case judged, and every fixture it names built.

No CLI call: the round itself runs the harness (`.venv/bin/python scripts/hostile-inputs.py`)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hostile():
    spec = importlib.util.spec_from_file_location("hostile_inputs", ROOT / "scripts" / "hostile-inputs.py")
    module = importlib.util.module_from_spec(spec)
    # dataclasses looks the module up by name while it builds Case.
    sys.modules["hostile_inputs"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["hostile_inputs"]


def test_the_catalogue_holds_at_least_134_distinct_judged_cases(hostile):
    args = [case.args for case in hostile.CASES]
    assert len(set(args)) == len(args) >= 134, [a for a in args if args.count(a) > 1]
    assert {case.expect for case in hostile.CASES} <= set(hostile.EXPECTATIONS)
    # A refusal with a long timeout would let a wrongly accepted run train before the case is judged.
    assert all(case.timeout_s <= 30 for case in hostile.CASES if case.expect == "refuse")


def test_every_placeholder_is_filled(hostile):
    places = {name: f"/{name}" for name in hostile.PLACES}
    for case in hostile.CASES:
        words = hostile.fill(case.args, places)
        assert not [w for w in words if re.search(r"\{\w+\}", w)], case.args


def test_every_fixture_a_case_names_is_built(hostile, tmp_path):
    """A misspelt fixture would turn a case about a bad file into one about a missing file; only names with
    "nosuch" in them are meant to be missing."""
    fx = tmp_path / "fx"
    hostile.build_fixtures(fx)
    for case in hostile.CASES:
        for word in hostile.fill(case.args, {"fx": str(fx), "repo": str(ROOT), "cwd": str(tmp_path)}):
            for path in re.findall(rf"{re.escape(str(fx))}[^\s:]*", word):
                if "nosuch" not in path:
                    assert Path(path).exists(), f"{case.args}: {path} is not built"


def test_training_commands_are_bounded_without_overriding_the_case(hostile):
    words = hostile.fill("run --steps 0 --model tiny", {})
    assert words[0] == "run" and words[-4:] == ["--steps", "0", "--model", "tiny"]
    assert "--steps" not in words[1:-4] and {"--batch-size", "--seq-len", "--profile"} <= set(words)
    assert hostile.fill("profiles show x.yaml", {}) == ["profiles", "show", "x.yaml"]
