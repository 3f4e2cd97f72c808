"""The one style of every figure analysis draws (report/figures.py for `harness plot`, report/compare_figures.py for
`harness compare`, report/trace_figure.py for a replayed link): the files each is saved as, the colours, the grid
and spread bands, and the validation-loss axes the loss figures share.

Figures are built as matplotlib Figure objects without pyplot, so they render with the Agg canvas whatever backend
the machine is configured for, and nothing global (no rcParams) is set or left behind: the defaults are here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

FORMATS = ("png", "svg")
DPI = 150
GRID_ALPHA = 0.3
BAND_ALPHA = 0.15  # a ± 1 std band, or an interval, behind its line
LOSS_FIGSIZE = (12, 4.8)
# Final times this many times apart go on a log axis: a slow baseline on a slow link takes hundreds of times longer
# than the rest, which a linear axis would hide.
LOG_TIME_RATIO = 10


def palette() -> tuple:
    """The colours, in order: a variant (or a cluster) keeps its colour in every figure."""
    return matplotlib.colormaps["tab10"].colors


def variant_colors(variants: Sequence[str]) -> dict[str, str]:
    """Each variant's colour, in the order given."""
    colors = palette()
    return {v: matplotlib.colors.to_hex(colors[i % len(colors)]) for i, v in enumerate(variants)}


def save(fig: Figure, out: Path, name: str) -> list[Path]:
    """`fig` as out/name.png and out/name.svg."""
    paths = []
    for fmt in FORMATS:
        path = out / f"{name}.{fmt}"
        fig.savefig(path, dpi=DPI, bbox_inches="tight")
        paths.append(path)
    return paths


def band(ax: Axes, x: pd.Series, mean: pd.Series, std: pd.Series, color: str) -> None:
    """A ± 1 std band around a mean line."""
    ax.fill_between(x, mean - std, mean + std, color=color, alpha=BAND_ALPHA, linewidth=0)


def loss_axes(fig: Figure) -> tuple[Axes, Axes]:
    """Validation loss against tokens trained (left) and against training wall-clock (right), one loss axis."""
    by_tokens, by_time = fig.subplots(1, 2, sharey=True)
    by_tokens.set_xlabel("tokens trained (all clusters)")
    by_tokens.set_ylabel("validation loss (nats per token)")
    by_tokens.xaxis.set_major_formatter(EngFormatter(sep=""))
    return by_tokens, by_time


def log_time(finals: Sequence[float]) -> bool:
    """Whether final times this far apart go on a log axis (LOG_TIME_RATIO)."""
    finals = pd.Series(finals, dtype=float)
    return bool(len(finals) and finals.min() > 0 and finals.max() / finals.min() > LOG_TIME_RATIO)
