"""Fake compare folders for the tests of `harness compare`: runs whose steps take a known time and whose losses are
known, in the layout its sweeps write (harness/analysis/experiments/compare.py), and a row picked out of the result."""

from __future__ import annotations

import pandas as pd

from harness.analysis.plan import CompareSpec
from harness.analysis.report.time_to_target import MEASURED
from tests.harness.fakeruns import write_run

LOSSES = {"allreduce": (5.5, 4.5, 4.0, 3.8, 3.7), "opendiloco": (5.5, 4.7, 4.1, 3.9, 3.85)}
SPEED = {"allreduce": 1000.0, "opendiloco": 4000.0, "local": 8000.0}
H10 = {"opendiloco": {"local_steps": 10}}


def fake_run(root, combo, steps: int, slower: float = 1.0, **kwargs) -> None:
    """A fake run of `combo` whose steps take a fixed time: the method's SPEED, 5% faster per seed, / `slower`."""
    method = combo.method
    write_run(
        root, combo.name, method, combo.profile, combo.seed,
        tokens_per_s=SPEED[method] * (1 + 0.05 * combo.seed) / slower,
        val_losses=LOSSES.get(method, (5.5, 5.0, 4.8, 4.7, 4.6)), steps=steps,
        options=H10.get(method), sync_every=10 if method == "opendiloco" else 1, **kwargs,
    )  # fmt: skip


def fake_compare(out, spec: CompareSpec, slower: dict[str, float] | None = None) -> None:
    """Every run `spec` asks for, as fake runs: the full runs at 40 steps, the traces at their own length, `slower`
    times slower on the profiles it names."""
    for combo in spec.full_sweep().combinations():
        fake_run(out / "runs", combo, 40, (slower or {}).get(combo.profile, 1.0))
    if spec.composed:
        lengths = spec.trace_steps()
        for combo in spec.trace_sweep().combinations():
            fake_run(out / "traces" / "runs", combo, lengths[combo.method], (slower or {}).get(combo.profile, 1.0))


def spec_of(methods=("allreduce", "opendiloco"), profiles=("1gbps",), composed=(), seeds=(0, 1, 2), **kw):
    return CompareSpec(methods, profiles, composed, seeds, {"steps": 40}, per_method=H10, **kw)


def row(table: pd.DataFrame, method: str, profile: str = "1gbps", how: str = MEASURED) -> pd.Series:
    return table[(table["method"] == method) & (table["profile"] == profile) & (table["how"] == how)].iloc[0]
