"""A run's method options as analysis reads them: what makes two runs the same variant, and the variant's label.

A run records every option its method ran with, defaults included (summary.json's `method_options`, from
trainers.registry.recorded_options), next to the options it was given (`method_options_given`). Two runs are the
same variant iff those resolved options are equal, so runs made before and after a default changed stay apart; a
setting added to a method later reads, in a run made before it, as the value that run ran with (the field's
`before_it_existed`, e.g. dilocox's exchange=gather), so long-lived reference runs stay comparable. A
variant's label names only what differs from the method's defaults in this checkout (`dilocox (rank=32)`; the
default variant is just `dilocox`).

A run folder written before runs recorded resolved options (its summary has no `method_options_given`) holds only the
options it was given, and the defaults of the commit that made it are not known here. Such a run is read as its given
options over this checkout's defaults, and marked: `recorded` is False, its label ends in AS_GIVEN, it is never the
same variant as a run that recorded its options, and the report names the commits that made them
(docs/comparisons.md, "Variants").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.run.folder import RunPaths, UnreadableResults, read_environment
from trainers.registry import is_method, options_shown, resolved_options, with_later_settings

AS_GIVEN = "[options as given]"


@dataclass(frozen=True)
class RunOptions:
    method: str
    # Every option of the method; for a run that did not record them, its given ones over this checkout's
    # defaults; None where this checkout's method refuses them (an option since removed).
    resolved: dict[str, Any] | None
    given: dict[str, Any]
    recorded: bool  # resolved when the run was recorded (False: an older folder, read as above)
    commit: str | None = None  # the commit that made a run that did not record them (its environment.json)

    @property
    def key(self) -> str:
        """Equal for two runs iff they are the same variant."""
        return json.dumps([self.method, self.recorded, self.resolved, self.given if self.resolved is None else None],
                          sort_keys=True)  # fmt: skip

    @property
    def label(self) -> str:
        """'dilocox', 'dilocox (rank=32)', 'dilocox (local_steps=10) [options as given]'."""
        shown = self.given if self.resolved is None else _shown(self.method, self.resolved)
        text = self.method + (f" ({', '.join(f'{k}={v}' for k, v in shown.items())})" if shown else "")
        return text if self.recorded else f"{text} {AS_GIVEN}"


def _shown(method: str, resolved: Mapping[str, Any]) -> dict[str, Any]:
    return options_shown(method, resolved) if is_method(method) else dict(resolved)


def run_options(summary: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> RunOptions:
    """A run's options from its summary.json (its config.json where the summary lacks them), read as the module doc
    says; run_options_in adds the commit that made a run that did not record them."""
    source = summary if "method_options" in summary or config is None else config
    options, given = dict(source.get("method_options") or {}), source.get("method_options_given")
    method = summary["method"]
    if given is not None:
        return RunOptions(method, with_later_settings(method, options), dict(given), recorded=True)
    try:
        resolved = resolved_options(method, options) if is_method(method) else None
    except (ValueError, TypeError):
        resolved = None
    return RunOptions(method, resolved, options, recorded=False)


def run_options_in(run_dir: Path, summary: Mapping[str, Any]) -> RunOptions:
    """run_options, with the commit that made a run that did not record its options (environment.json)."""
    options = run_options(summary)
    if options.recorded:
        return options
    try:
        commit = read_environment(run_dir).get("git_commit") if RunPaths(run_dir).environment.is_file() else None
    except UnreadableResults:
        commit = None
    return RunOptions(options.method, options.resolved, options.given, False, commit)


def unique_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """key -> label, with a short digest of the key added to any label that two keys share (options recorded by
    code whose config had fields this one lacks can name the same options), so a label still names one variant."""
    keys_of: dict[str, list[str]] = {}
    for key, label in labels.items():
        keys_of.setdefault(label, []).append(key)
    return {
        key: label if len(keys_of[label]) == 1 else f"{label} #{hashlib.sha256(key.encode()).hexdigest()[:6]}"
        for key, label in labels.items()
    }


def not_recorded_note(commits: Sequence[object]) -> str:
    """The report's note on runs marked AS_GIVEN; `commits`: one per such run."""
    made = sorted({c[:7] for c in commits if isinstance(c, str) and c}) or ["unknown"]
    runs = "run" if len(commits) == 1 else "runs"
    return (
        f"{len(commits)} {runs} marked {AS_GIVEN} recorded only the options given, not the defaults they ran with "
        f"(made before runs recorded resolved options, at commit {', '.join(made)}): they are read as those options "
        "over this checkout's defaults, which may not be the defaults of the commit that made them, and kept apart "
        "from runs that recorded theirs; rerun them to compare them as variants."
    )
