"""Run folders with known (made-up) numbers for the tests of the tidy tables, the comparison and the report, and
helpers that pick rows and cells out of them."""

from __future__ import annotations

import pandas as pd
import pytest

from tests.harness.fakeruns import write_run


@pytest.fixture
def sweep_results(tmp_path):
    """Two seeds each of allreduce, opendiloco (H=10) and local on 1gbps; one allreduce on 100mbps; one failure."""
    root = tmp_path / "sweep" / "runs"
    h10 = {"local_steps": 10}
    for name, method, seed, tokens_per_s, wire, losses, options in (
        ("ar-s0", "allreduce", 0, 1000, 400, (5.5, 4.4, 4.0), {}),
        ("ar-s1", "allreduce", 1, 1200, 400, (5.5, 4.2, 3.8), {}),
        ("dl-s0", "opendiloco", 0, 5500, 4, (5.5, 4.6, 4.1), h10),
        ("dl-s1", "opendiloco", 1, 5500, 4, (5.5, 4.8, 4.3), h10),
        ("local-s0", "local", 0, 11000, 0, (5.5, 5.0, 4.9), {}),
    ):
        write_run(root, name, method, seed=seed, tokens_per_s=tokens_per_s, wire_bytes_per_token=wire,
                  val_losses=losses, options=options)  # fmt: skip
    write_run(root, "ar-100", "allreduce", profile="100mbps", tokens_per_s=300, val_losses=(5.5, 4.4, 4.0))
    write_run(root, "broken", "opendiloco", failure="rank 1 exited with code 1", options=h10)
    return tmp_path / "sweep"


def row(table: pd.DataFrame, variant: str, profile: str = "1gbps") -> pd.Series:
    return table[(table["variant"] == variant) & (table["profile"] == profile)].iloc[0]


def cells_of(text: str, variant: str, profile: str = "1gbps") -> list[str]:
    """The cells of the first markdown row whose method starts with `variant`, in `profile`'s section."""
    section = text[text.index(f"### {profile} ") :]
    line = next(x for x in section.splitlines() if x.startswith(f"| {variant}"))
    return [c.strip() for c in line.strip().strip("|").split("|")]
