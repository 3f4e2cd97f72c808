"""The files of a comparison (harness/analysis/report/time_to_target.py's Comparison) in its folder: compare.json,
compare.md, compare.csv and speedup_vs_target.csv (harness/analysis/report/compare.py, target_curve.py), headline.md
(harness/analysis/report/headline.py: what README prints) and figures/ (compare_figures.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from harness.analysis.report.compare import compare_markdown, composition_notes, control_note, host_busy_note, how_label
from harness.analysis.report.compare_figures import write_figures
from harness.analysis.report.headline import headline_markdown
from harness.analysis.report.target_curve import speedup_curve, speedup_curve_figures
from harness.analysis.report.time_to_target import Comparison


def _records(table: pd.DataFrame) -> list[dict[str, Any]]:
    """JSON-ready rows: NaN as null."""
    return json.loads(table.to_json(orient="records")) if not table.empty else []


def write_outputs(comparison: Comparison, out: Path, command: str | None) -> list[Path]:
    """The comparison's files in `out` (module doc); their paths."""

    rows = comparison.rows
    document = {
        "command": command,
        "settings": comparison.spec.record(),
        "target": {
            "loss": comparison.target_loss,
            "source": comparison.target_source,
            "rule": comparison.target_rule,
            # Profiles where local, which never communicates, reaches the target (control_note).
            "reached_by_control": [p for p, group in rows.groupby("profile", sort=False) if control_note(group)],
        },
        "profiles": [
            {"profile": profile, "rows": _records(group.assign(how_label=group.apply(how_label, axis=1)))}
            for profile, group in rows.groupby("profile", sort=False)
        ],
        "validation": _records(comparison.validation),
        "notes": [*composition_notes(comparison), *filter(None, [host_busy_note(comparison)])],
        "failed": list(comparison.failed),
    }
    paths = [
        out / "compare.json", out / "compare.md", out / "compare.csv", out / "speedup_vs_target.csv",
        out / "headline.md",
    ]  # fmt: skip
    paths[0].write_text(json.dumps(document, indent=2, default=str) + "\n")
    paths[1].write_text(compare_markdown(comparison, command))
    rows.assign(how_label=rows.apply(how_label, axis=1)).to_csv(paths[2], index=False)
    curve = speedup_curve(comparison)
    curve.to_csv(paths[3], index=False)
    paths[4].write_text(headline_markdown(comparison))
    figures = out / "figures"
    return [*paths, *write_figures(comparison, figures), *speedup_curve_figures(curve, comparison.target_loss, figures)]
