"""What a run reads from outside the repository, recorded so that its folder alone says what ran.

A `--model` config (and the checkpoint beside it), `--data` and a `--tokenizer` file are named by the user, often
by a relative path, and may change after the run. `absolute_paths` fixes each to the absolute path it was read
from before the run's config is saved; `input_record` is config.json's `inputs`: each input's path and the SHA-256
of what was read - the files for a model config, checkpoint and tokenizer file, and for the data the same corpus
hash the ranks log at start (`corpus_sha256`: the documents as read, in order, at most the bytes a run reads). A
built-in model, byte tokens and bpe:N hold no outside file (bpe:N is trained from the recorded data, its own hash
in the ranks' start event); the default corpus is this Python's standard library, recorded with its hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from trainers.config import TrainConfig
from trainers.registry import is_file_spec

CHUNK_BYTES = 1 << 20


def absolute_paths(train: TrainConfig) -> TrainConfig:
    """`train` with its model, data and tokenizer paths made absolute (names such as tiny or bpe:N unchanged).

    A path that does not exist is left as given, for validation to refuse in the user's own words."""
    paths = {"model": train.model if _names_a_model_file(train.model) else None, "data": train.data}
    if train.tokenizer != "bytes" and not train.tokenizer.startswith("bpe:"):
        paths["tokenizer"] = train.tokenizer
    changes = {k: str(Path(p).expanduser().absolute()) for k, p in paths.items() if p and _exists(p)}
    return dataclasses.replace(train, **changes)


def _exists(path: str) -> bool:
    try:
        return Path(path).expanduser().exists()
    except OSError:  # a name too long, a loop of links: validation names it
        return False


def _names_a_model_file(model: str) -> bool:
    if "/" in model or model.endswith(".json"):
        return True
    if not _exists(model):
        return False
    # A bare name that is also a file here: a built-in model's name wins (trainers.models.get_model_config). Only
    # this rare case pays for importing torch.
    from trainers.models import MODEL_CONFIGS

    return model not in MODEL_CONFIGS


def input_record(train: TrainConfig, method_source: str = "") -> dict[str, Any]:
    """config.json's `inputs`: for each outside input the run reads, where from and the SHA-256 of what was read
    (`method_source`: a method from a file, whose file is one)."""
    from trainers.data import corpus_sha256
    from trainers.hf_models import load_config
    from trainers.models import MODEL_CONFIGS
    from trainers.tokenizer import parse_tokenizer

    record: dict[str, Any] = {}
    if train.model not in MODEL_CONFIGS:
        config = load_config(train.model)
        record["model_config"] = _file(config.config_path)
        if config.checkpoint is not None:
            record["model_checkpoint"] = _file(config.checkpoint)
    record["data"] = {
        "path": train.data,
        "sha256": corpus_sha256(train.data, train.data_field),
        "hash_of": "the documents as read, joined in order (the ranks' start event corpus_sha256)",
    }
    spec = parse_tokenizer(train.tokenizer)
    if spec.kind == "file":
        record["tokenizer"] = _file(spec.path)
    if is_file_spec(method_source):
        record["method"] = _file(Path(method_source.rpartition(":")[0]))
    return record


def check_unchanged(recorded: dict[str, Any], train: TrainConfig, source: Path, method_source: str = "") -> None:
    """Refuse to rerun the run whose config.json (`source`) recorded `recorded` where a file it read, still at the
    same path, has changed since: the rerun would not be that run. Raises UserError naming the file."""
    from harness.errors import UserError

    try:
        now = input_record(train, method_source)
    except (OSError, ValueError):
        return  # a file gone or unreadable: validation refuses it in its own words
    for name, then in recorded.items():
        current = now.get(name)
        if current is None or current.get("path") != then.get("path") or current["sha256"] == then.get("sha256"):
            continue
        what = then.get("path") or "the default corpus (this Python's standard library)"
        raise UserError(
            f"{what} has changed since the run in {source} read it ({name} sha256 {then.get('sha256', '?')[:12]} "
            f"then, {current['sha256'][:12]} now), so this would not rerun that run; restore the file, or name it "
            "again on the command line to run on it as it is"
        )


def _file(path: Path) -> dict[str, str]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return {"path": str(Path(path).absolute()), "sha256": digest.hexdigest()}
