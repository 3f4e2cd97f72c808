"""scripts/gate-selftest.py: each regression it injects must still apply to this checkout's code (its anchor found
exactly once), or the self-test would stop testing what it says. Running it is the script's own job (.ci/run)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from harness.analysis.gate.bands import METRICS
from trainers.registry import METHODS

ROOT = pathlib.Path(__file__).parents[4]


def selftest():
    spec = importlib.util.spec_from_file_location("gate_selftest", ROOT / "scripts" / "gate-selftest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


SELFTEST = selftest()


@pytest.mark.parametrize("injection", SELFTEST.INJECTIONS, ids=lambda i: i.name)
def test_every_injection_applies_to_this_code_and_names_a_gated_metric(injection):
    assert injection.method in METHODS and injection.metric in METRICS
    for edit in injection.edits:
        text = (ROOT / edit.path).read_text()
        assert text.count(edit.anchor) == 1
        changed = SELFTEST.patched(injection.name, edit, text)
        assert changed != text
        compile(changed, edit.path, "exec")


def test_an_anchor_that_moved_is_named():
    moved = SELFTEST.Edit("x.py", "gone\n", "")
    with pytest.raises(SystemExit, match="moved: its anchor occurs 0 times in x.py; update the self-test"):
        SELFTEST.patched("moved", moved, "text\n")


def test_the_check_table_is_read_for_what_failed():
    table = (
        "| verdict | method | profile | metric | measured |\n|:--|:--|:--|:--|--:|\n"
        "| holds   | local  | 100mbps | final_val_loss | 3.6 |\n| ABOVE   | dilocox | 10mbps | step_overhead | 1.4 |\n"
    )
    assert SELFTEST.failed_bands(table) == {("dilocox", "step_overhead")}
