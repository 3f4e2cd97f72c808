"""scripts/site-cost.py recomputes, from the committed runs, what results/reference/uneven-sites-20-tiny/README.md
prints: each method's tokens/s with one straggler over the spread's, paired per seed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "results" / "reference" / "uneven-sites-20-tiny"


def test_the_committed_study_gives_the_documented_ratios():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "site-cost.py"), str(STUDY), "spread", "straggler"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    rows = {line.split(" | ")[0].strip("| "): line for line in result.stdout.splitlines()[2:]}
    assert "| 0.175 +- 0.008 | 0.176, 0.177, 0.171 | 1.0549 | 1.0630 |" in rows["allreduce"]
    assert "| 0.513 +- 0.052 | 0.529, 0.489, 0.520 |" in rows["opendiloco"]
    assert "| 0.715 +- 0.150 | 0.646, 0.746, 0.754 |" in rows["dilocox"]
    # Each ratio is the straggler run's tokens/s over the spread run's of the same seed, as the README says.
    readme = (STUDY / "README.md").read_text()
    assert "| allreduce | 1,267 +- 56 | 222 +- 1 | 0.175 +- 0.008 | 0.176, 0.177, 0.171 |" in readme
