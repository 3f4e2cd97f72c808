"""Adding a method is its file and one registry line: a copy of the package with a new method, made exactly so, must
run, sweep, report and project it through the CLI with nothing else edited.

The copy holds harness/, trainers/ and netem_profiles/; the new method `toyreduce` is trainers/methods/allreduce.py with
its classes renamed, and trainers/registry.py gains one line. The CLI runs as subprocesses from the copy (sys.path's
first entry, ahead of the editable install), so a name list anywhere else in the code (a branch per method, a
table of methods) fails these tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.userns import user_namespaces_work

REPO = Path(__file__).resolve().parents[2]
METHOD = "toyreduce"
REGISTRY_LINE = f'    "{METHOD}": "trainers.methods.{METHOD}:ToyReduce",\n'
# Three steps: enough exchanges that nothing warns of too few, and little enough to keep each run at its start-up.
TINY_RUN = ["--model", "tiny", "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--eval-every", "3"]


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the package whose only changes are the new method's file and its registry line."""
    root = tmp_path_factory.mktemp("plugin")
    for name in ("harness", "trainers", "netem_profiles"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    source = (REPO / "trainers" / "methods" / "allreduce.py").read_text()
    renamed = source.replace("AllReduceConfig", "ToyReduceConfig").replace("class AllReduce(", "class ToyReduce(")
    assert renamed.count("ToyReduce") >= 3, "trainers/methods/allreduce.py no longer has the classes this test renames"
    (root / "trainers" / "methods" / f"{METHOD}.py").write_text(renamed)
    registry = root / "trainers" / "registry.py"
    lines = registry.read_text().splitlines(keepends=True)
    opening = next(i for i, line in enumerate(lines) if line.startswith("BUILT_IN"))
    lines.insert(opening + 1, REGISTRY_LINE)
    registry.write_text("".join(lines))
    return root


def cli(package: Path, *args: object, timeout: float = 120) -> str:
    """The command's output; it must succeed."""
    env = {**os.environ, "PYTHONPATH": str(package), "COLUMNS": "300"}
    result = subprocess.run(
        [sys.executable, "-m", "harness.cli", *map(str, args)],
        cwd=package,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"harness {args[0]}: {result.stdout}{result.stderr}"
    return result.stdout


def test_the_registry_gains_one_line(package):
    registry = (package / "trainers" / "registry.py").read_text()
    assert registry.count(REGISTRY_LINE) == 1
    assert registry.replace(REGISTRY_LINE, "", 1) == (REPO / "trainers" / "registry.py").read_text()


def test_project_predicts_the_new_method(package):
    out = cli(package, "project", "--method", METHOD, "--compute-s", "0.05", "--profile", "100mbps", "--model", "tiny")
    assert out.startswith(f"{METHOD} ·") and "predicted:" in out, out
    # The same bytes as the method it copies: the prediction comes from the method's own declaration.
    assert "3,502,080 B from each site every 1 step(s)" in out, out


@pytest.mark.e2e
@pytest.mark.skipif(
    os.geteuid() != 0 and not user_namespaces_work(), reason="needs root or user namespaces to build network namespaces"
)
def test_run_sweep_and_report_take_the_new_method(package, tmp_path):
    # A sweep runs each combination through `harness run`'s runner into an ordinary folder: it covers `run` too.
    sweep = tmp_path / "sweep"
    cli(package, "sweep", "--methods", f"{METHOD},allreduce", "--profiles", "100mbps", *TINY_RUN,
        "--out", sweep, timeout=240)  # fmt: skip
    (run,) = (sweep / "runs").glob(f"{METHOD}-*")
    summary = (run / "summary.json").read_text()
    assert f'"method": "{METHOD}"' in summary and '"status": "ok"' in summary, summary
    table = cli(package, "report", sweep)
    assert f"| {METHOD} " in table and "| allreduce " in table, table
