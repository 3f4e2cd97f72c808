"""Markdown as all of analysis writes it: the one table writer, and the cells of a figure with its spread.

Every markdown table goes through markdown_table: `harness report`'s and `harness compare`'s (report/results.py,
report/compare.py), the gate's (gate/check.py, gate/baseline.py, gate/baseline_diff.py) and
`harness project --validate`'s. Plain markdown, so CI logs (narrow: a rich table wraps) and files read alike.

A figure with its spread is written as report/aggregates.py aggregates it: '1,100 ± 248' (n >= 3; '1,100
(900–1,400)' where the interval is not symmetric), '1,100 (range 1,000–1,200)' (n = 2), '1,000 (n=1, no spread)'; a
missing figure is '-'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pandas as pd

from harness.analysis.report.tables import missing


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], text_columns: int = 1) -> str:
    """A GitHub markdown table; the first `text_columns` left-aligned, the numbers after them right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    left = set(range(text_columns))

    def line(cells: Sequence[str]) -> str:
        padded = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(":" + "-" * (w + 1) if i in left else "-" * (w + 1) + ":" for i, w in enumerate(widths))
    return "\n".join([line(header), rule + "|", *(line(r) for r in rows)])


def blank(value: object) -> bool:
    """No figure to show: missing (None, NA) or NaN."""
    return missing(value) or (isinstance(value, float) and math.isnan(value))


def with_spread(
    mean: float, n: int, low: float, high: float, fmt: Callable[[float], str], half: Callable[[float], str], note=""
) -> str:
    """'1,100 ± 248' (n >= 3), '1,100 (range 1,000–1,200)' (n = 2), '1,000 (n=1, no spread)'; `note` goes inside
    the parentheses."""
    if blank(mean):
        return "-"
    extra = f", {note}" if note else ""
    if n >= 3 and not blank(low):
        # An interval that was widened on one side only (time_to_target._with_composition_error) shows its ends.
        if not math.isclose(high - mean, mean - low, rel_tol=1e-6, abs_tol=1e-9 * abs(mean)):
            return f"{fmt(mean)} ({fmt(low)}–{fmt(high)}{extra})"
        return f"{fmt(mean)} ± {half(high - mean)}" + (f" ({note})" if note else "")
    if n == 2 and not blank(low):
        return f"{fmt(mean)} (range {fmt(low)}–{fmt(high)}{extra})"
    if n == 1:
        return f"{fmt(mean)} (n=1, no spread{extra})"
    return fmt(mean) + (f" ({note})" if note else "")


def spread_cell(
    r: pd.Series, name: str, fmt: Callable[[float], str], half: Callable[[float], str], note: str = ""
) -> str:
    """with_spread of a row's spread columns `name`, `name`_n, `name`_low, `name`_high (aggregates.spread_columns)."""
    return with_spread(r[name], r[f"{name}_n"], r[f"{name}_low"], r[f"{name}_high"], fmt, half, note)


# --- the figures' formats ------------------------------------------------------------------------------------------


def count(value: float) -> str:
    return format(value, ",.0f")


def significant(value: float, digits: int, signed: bool = False) -> str:
    """`value` to `digits` significant figures, written out: 0.38, 7.8, 100, 1,010 - never '1e+02', which a table
    reader takes for a typo."""
    sign = "+" if signed else ""
    text = format(value, f"{sign}.{digits}g")
    return format(float(text), f"{sign},.0f") if "e+" in text else text


def percent(share: float) -> str:
    return "-" if blank(share) else f"{significant(100 * share, 3)}%"


def half_percent(value: float) -> str:
    return f"{significant(100 * value, 2)}%"


def half_times(value: float) -> str:
    """A ratio's spread: '0.38', '100'."""
    return significant(value, 2)


def times(value: float) -> str:
    """A ratio: '3.2x'."""
    if blank(value):
        return "-"
    return "inf" if math.isinf(value) else f"{significant(value, 3)}x"


def change(ratio: float) -> str:
    """A ratio as a relative change: 1.048 -> '+4.8%'."""
    return "-" if blank(ratio) else f"{significant(100 * (ratio - 1), 3, signed=True)}%"


IN_SAMPLE_NOTE = (
    "in-sample: reported on seeds its method's settings were chosen on (the sweep's --selected-on), so its figures "
    "favour it; rerun it on other seeds for figures no choice saw."
)


def in_sample_label(name: str, chosen_seeds: object) -> str:
    """A row's name, marked where it is reported on seeds its settings were chosen on ("0,1,2"; "" or NaN: none)."""
    return f"{name} (in-sample: seeds {chosen_seeds})" if isinstance(chosen_seeds, str) and chosen_seeds else name
