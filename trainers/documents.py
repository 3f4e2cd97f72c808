"""Where training documents come from: text files, JSONL and parquet records, and saved `datasets` folders.

A document is one text file, or the text field of one record. Which reader a path gets is decided by what it is:
a folder saved by `datasets`' `save_to_disk` (it holds `dataset_info.json` and `state.json`, or
`dataset_dict.json`) is a dataset, a `*.jsonl` file holds one JSON object per line, a `*.parquet` file a table, and
every other file is text. A folder is walked for all of these, hidden entries (.git, .venv) left out.

Every reader stops once the documents hold the byte budget, so a 100 GB shard costs no more to open than the budget
(parquet and datasets are read a batch of rows at a time, only the text column).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path

# How many rows of a parquet file or dataset are read at a time: small enough that a budget cut wastes little.
ROW_BATCH = 1024


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a folder written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "dataset_info.json").is_file() and (path / "state.json").is_file())
    )


def source_files(path: Path) -> list[Path]:
    """The sources under `path` in a fixed order: files, and saved dataset folders as one source each."""
    if path.is_file() or is_saved_dataset(path):
        return [path]
    sources: list[Path] = []
    # Hidden entries are tooling, not text someone meant to train on.
    for entry in sorted(path.iterdir(), key=lambda p: p.name):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            sources += source_files(entry)
        elif entry.is_file():
            sources.append(entry)
    return sources


def read_text(f: Path, limit: int) -> bytes | None:
    """At most the first `limit` bytes of f, or None when they are not UTF-8 (a character cut at `limit` is fine).

    Only the bytes that can be used are read and decoded, so a huge file costs no more than the budget.
    """
    with f.open("rb") as fh:
        data = fh.read(limit + 1)
    whole = len(data) <= limit
    data = data[:limit]
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=whole)
    except UnicodeDecodeError:
        return None
    return data


def records(source: Path, text_field: str) -> Iterator[str]:
    """The text fields of a JSONL file, parquet file or saved dataset, in order; ValueError names a bad one."""
    if source.is_dir():
        return _dataset_texts(source, text_field)
    if source.suffix == ".parquet":
        return _parquet_texts(source, text_field)
    return _jsonl_texts(source, text_field)


def holds_records(source: Path) -> bool:
    return source.is_dir() or source.suffix in (".jsonl", ".parquet")


def _missing_field(where: str, text_field: str, fields: list[str]) -> ValueError:
    return ValueError(
        f"{where} has no {text_field!r} field (it has {', '.join(map(repr, fields)) or 'none'}); "
        f"pass --data-field with the one that holds the text"
    )


def _jsonl_texts(f: Path, text_field: str) -> Iterator[str]:
    with f.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{f} line {number} is not JSON ({err.msg}); fix it or leave the file out") from None
            if not isinstance(record, dict) or text_field not in record:
                fields = list(record) if isinstance(record, dict) else []
                raise _missing_field(f"{f} line {number}", text_field, fields)
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(
                    f"{f} line {number}: field {text_field!r} holds {type(text).__name__}, not text; "
                    "pass --data-field with the field that holds the text"
                )
            yield text


def _import(module: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(
            f"reading {what} needs {module.split('.')[0]}; install it with pip install -e '.[hf]'"
        ) from None


def _parquet_texts(f: Path, text_field: str) -> Iterator[str]:
    pq = _import("pyarrow.parquet", f"parquet ({f})")
    try:
        table = pq.ParquetFile(f)
    except Exception as err:
        raise ValueError(f"{f} is not a readable parquet file ({err}); fix it or leave it out of --data") from None
    fields = table.schema_arrow.names
    if text_field not in fields:
        raise _missing_field(str(f), text_field, fields)
    for batch in table.iter_batches(batch_size=ROW_BATCH, columns=[text_field]):
        yield from _strings(batch.column(0).to_pylist(), f"{f}", text_field)


def _dataset_texts(folder: Path, text_field: str) -> Iterator[str]:
    datasets = _import("datasets", f"a saved dataset ({folder})")
    try:
        dataset = datasets.load_from_disk(str(folder))
    except Exception as err:
        raise ValueError(f"{folder} cannot be read as a saved dataset ({err}); pass another --data") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise ValueError(
                f"{folder} is a DatasetDict without a 'train' split (it has {', '.join(dataset)}); "
                "save the split to train on as 'train'"
            )
        dataset = dataset["train"]
    if text_field not in dataset.column_names:
        raise _missing_field(str(folder), text_field, dataset.column_names)
    for batch in dataset.select_columns([text_field]).iter(batch_size=ROW_BATCH):
        yield from _strings(batch[text_field], str(folder), text_field)


def _strings(values: list, where: str, text_field: str) -> Iterator[str]:
    for value in values:
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(
                f"{where}: field {text_field!r} holds {type(value).__name__}, not text; "
                "pass --data-field with the field that holds the text"
            )
        yield value
