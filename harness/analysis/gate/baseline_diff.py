"""`harness baseline --diff OLD NEW`: what changed between two baseline files: where their runs were measured, the
run: settings, the checks and every band's reference and tolerance.

Read leniently (any metric name, the older `spread` beside today's `noise`), since the point is to compare a
baseline with the one that replaced it, which may be of an older format that `harness check` no longer accepts.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.analysis.gate.bands import CHECK_KEYS, BaselineError
from harness.analysis.report.markdown import markdown_table
from harness.errors import read_yaml

MEASURED_ON = "# The runs were measured on: "


def _read(path: Path) -> tuple[dict[str, Any], dict[tuple[str, str], dict[str, Mapping[str, Any]]], str]:
    """(run settings and the reference code, (method, profile) -> metric -> band, where the runs were measured) of a
    baseline file."""
    data = read_yaml(path, "baseline file", BaselineError)
    if not isinstance(data, dict) or not isinstance(data.get("run"), dict) or not isinstance(data.get("checks"), list):
        raise BaselineError(f"{path} is not a baseline file (a mapping with run: and a list of checks:)")
    checks: dict[tuple[str, str], dict[str, Mapping[str, Any]]] = {}
    for entry in data["checks"]:
        if not isinstance(entry, dict) or not all(k in entry for k in CHECK_KEYS):
            raise BaselineError(f"{path} has a check without method and profile: {entry!r}")
        bands = {k: v for k, v in entry.items() if k not in CHECK_KEYS and isinstance(v, dict)}
        checks[(str(entry["method"]), str(entry["profile"]))] = bands
    lines = path.read_text().splitlines()
    machine = next((line.removeprefix(MEASURED_ON).rstrip(".") for line in lines if line.startswith(MEASURED_ON)), "")
    return {**data["run"], "reference_code": data.get("reference_code")}, checks, machine


def _number(band: Mapping[str, Any], key: str) -> float | None:
    value = band.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _change(old: float | None, new: float | None) -> str:
    if old is None or new is None or old == 0:
        return "-"
    return f"{new / old - 1:+.2%}"


def diff_text(old_path: Path, new_path: Path) -> str:
    """The differences, as markdown: settings, checks added or dropped, and a table of every band in either."""
    old_run, old_checks, old_machine = _read(old_path)
    new_run, new_checks, new_machine = _read(new_path)
    out = [f"# {old_path} -> {new_path}", ""]
    if old_machine != new_machine:
        unknown = "(not recorded)"
        out += [f"measured on: {old_machine or unknown}", f"        now: {new_machine or unknown}", ""]
    changed = [k for k in dict.fromkeys([*old_run, *new_run]) if old_run.get(k) != new_run.get(k)]
    if changed:
        out.append("run: settings (and the reference code) that changed:")
        out += [f"- {k}: {old_run.get(k, '(unset)')!r} -> {new_run.get(k, '(unset)')!r}" for k in changed]
    else:
        out.append("run: settings unchanged")
    out.append("")
    for key in old_checks.keys() - new_checks.keys():
        out.append(f"- check dropped: {key[0]} on {key[1]}")
    for key in new_checks.keys() - old_checks.keys():
        out.append(f"- check added: {key[0]} on {key[1]}")
    header = ["method", "profile", "metric", "old reference", "new reference", "change", "old tolerance",
              "new tolerance", "noise (new)"]  # fmt: skip
    rows = []
    for key in dict.fromkeys([*old_checks, *new_checks]):
        old_bands, new_bands = old_checks.get(key, {}), new_checks.get(key, {})
        for metric in dict.fromkeys([*old_bands, *new_bands]):
            old, new = old_bands.get(metric, {}), new_bands.get(metric, {})
            old_ref, new_ref = _number(old, "reference"), _number(new, "reference")
            rows.append([
                key[0], key[1], metric + ("" if new else " (dropped)") + ("" if old else " (new)"),
                _shown(old_ref), _shown(new_ref), _change(old_ref, new_ref),
                _shown(_number(old, "tolerance")), _shown(_number(new, "tolerance")),
                _shown(_number(new, "noise")),
            ])  # fmt: skip
    if rows:
        out += ["", markdown_table(header, rows, text_columns=3)]
    return "\n".join(out).rstrip() + "\n"
