"""`harness report`'s tables as files: the comparison as CSV or parquet, the tidy tables as CSV (report/tables.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd

from harness.analysis.report.aggregates import ReportError
from harness.analysis.report.tables import RunTables


def parquet_engine() -> str | None:
    for engine in ("pyarrow", "fastparquet"):
        if importlib.util.find_spec(engine) is not None:
            return engine
    return None


def write_csv(table: pd.DataFrame, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(path, index=False)
    return path


def write_parquet(table: pd.DataFrame, path: Path) -> Path:
    """Parquet needs pyarrow or fastparquet; neither is a dependency, so say so instead of failing deep in pandas."""
    engine = parquet_engine()
    if engine is None:
        raise ReportError(
            f"cannot write {path}: parquet needs pyarrow or fastparquet and neither is installed "
            "(pip install pyarrow), or use --csv"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_parquet(path, engine=engine, index=False)
    return path


def write_tables(tables: RunTables, folder: Path) -> list[Path]:
    """The tidy tables as folder/runs.csv, folder/events.csv and folder/sites.csv."""
    return [
        write_csv(tables.runs, folder / "runs.csv"),
        write_csv(tables.events, folder / "events.csv"),
        write_csv(tables.sites, folder / "sites.csv"),
    ]
