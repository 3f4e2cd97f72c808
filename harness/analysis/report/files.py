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


def output_folder(folder: Path) -> Path:
    """`folder`, made with its parents if missing; ReportError naming it where it cannot be (a file in the way, no
    permission, a read-only file system)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ReportError(f"cannot write into {folder} ({err.strerror or err}); pass a writable folder") from None
    return folder


def write_csv(table: pd.DataFrame, path: Path) -> Path:
    output_folder(path.parent)
    try:
        table.to_csv(path, index=False)
    except OSError as err:
        raise ReportError(f"cannot write {path} ({err.strerror or err}); pass a writable path") from None
    return path


def write_parquet(table: pd.DataFrame, path: Path) -> Path:
    """Parquet needs pyarrow or fastparquet; neither is a dependency, so say so instead of failing deep in pandas."""
    engine = parquet_engine()
    if engine is None:
        raise ReportError(
            f"cannot write {path}: parquet needs pyarrow or fastparquet and neither is installed "
            "(pip install pyarrow), or use --csv"
        )
    output_folder(path.parent)
    table.to_parquet(path, engine=engine, index=False)
    return path


def write_tables(tables: RunTables, folder: Path) -> list[Path]:
    """The tidy tables as folder/runs.csv, folder/events.csv and folder/sites.csv."""
    return [
        write_csv(tables.runs, folder / "runs.csv"),
        write_csv(tables.events, folder / "events.csv"),
        write_csv(tables.sites, folder / "sites.csv"),
    ]
