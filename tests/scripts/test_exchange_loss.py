"""scripts/exchange-loss.py recomputes, from the committed runs, the paired figures docs/studies.md prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "results" / "reference"


def table(*folders: str, pair_with: str | None = None) -> subprocess.CompletedProcess:
    pairing = [] if pair_with is None else ["--pair-with", str(REFERENCE / pair_with)]
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "exchange-loss.py"), *pairing, *(str(REFERENCE / f) for f in folders)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def test_the_committed_studies_give_the_documented_pairs():
    result = table("exchange-loss-tiny-2000")
    assert result.returncode == 0, result.stderr
    assert "| dilocox | exchange=gather, rank=64, local_steps=50, adaptive=True | 3 | 3,4,5 | 1.517 +- 0.027 | - |" in (
        result.stdout
    )
    assert "| exchange=reduce, reduce_wire=int8 | 3 | 3,4,5 | 1.606 +- 0.049 | 5.86% +- 1.34% | 7.2 | 23.7 |" in (
        result.stdout
    )
    # The frontier's reduce runs pair with the bf16 study's gather runs (training is deterministic here).
    for folders in (["exchange-loss-bf16-2000"], ["exchange-fixed-pair-2000"],
                    ["exchange-loss-bf16-2000", "exchange-reduce-frontier-2000"],
                    ["exchange-loss-bf16-2000", "exchange-reduce-int4-2000"]):  # fmt: skip
        recomputed = table(*folders)
        assert recomputed.returncode == 0, recomputed.stderr
        assert recomputed.stdout == (REFERENCE / folders[-1] / "loss.md").read_text()


def test_studies_with_a_gather_of_their_own_pair_with_one_named_gather():
    # docs/studies.md: the fixed pair's reduce against the default (adaptive) gather, each named by its folder.
    result = table("exchange-fixed-pair-2000", pair_with="exchange-loss-bf16-2000")
    assert result.returncode == 0, result.stderr
    rows = result.stdout.splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == [
        "| dilocox",
        "| exchange-fixed-pair-2000/dilocox",
        "| exchange-fixed-pair-2000/dilocox@int8",
    ]
    assert (
        "| exchange=gather, rank=48, local_steps=64, adaptive=False | 3 | 3,4,5 | 1.508 +- 0.021 | -0.63% +- 0.61%"
        in (rows[1])
    )
    assert "| 1.521 +- 0.027 | 0.24% +- 0.19% | 12.0 | 32.0 |" in rows[2]


def test_the_int4_reduce_at_h48_ends_below_the_default_gather_at_fewer_bytes():
    """docs/studies.md and README: -1.39% +- 0.31% at 10.7 against the gather's 11.6 B/token."""
    rows = (REFERENCE / "exchange-reduce-int4-2000" / "loss.md").read_text().splitlines()
    h48 = next(row for row in rows if row.startswith("| dilocox@int4r64h48 |"))
    assert "| 1.496 +- 0.031 | -1.39% +- 0.31% | 10.7 | 42.0 |" in h48


def test_two_folders_holding_the_same_variant_and_seed_are_refused():
    result = table("exchange-loss-tiny-2000", "exchange-loss-bf16-2000")
    assert result.returncode != 0
    assert "a second dilocox run of seed 3; pass folders that do not overlap" in result.stderr
