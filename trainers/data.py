"""Offline training data: a byte-level corpus, per-replica shards and a fixed held-out split.

Nothing is downloaded. The default corpus is this Python's own standard library, which every machine running
the harness already has; `--data PATH` swaps in any text file or directory of text files.
"""

import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# Byte-level stand-in for <|endoftext|>: ASCII "end of transmission" never occurs in source code.
DOC_SEPARATOR = b"\x04"


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8 token ids
    val: torch.Tensor  # uint8 held-out ids, disjoint from train
    source: str  # human-readable description of what was loaded
    sha256: str  # of the concatenated bytes (train and val documents in file order)


def _stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "site-packages"]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return root, sorted(files, key=lambda f: f.relative_to(root).as_posix())


def _user_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    # Hidden entries (.git, .venv, editor state) are tooling, not text someone meant to train on.
    visible = (f for f in path.rglob("*") if not any(p.startswith(".") for p in f.relative_to(path).parts))
    return sorted((f for f in visible if f.is_file()), key=lambda f: f.relative_to(path).as_posix())


def _read_documents(files: list[Path], max_bytes: int) -> list[bytes]:
    """Read files in order until they hold max_bytes (the last one cut to fit), skipping empty files.

    Non-UTF-8 files are skipped too, rather than decoded with replacement: in a directory of text they are
    almost always binaries (images, archives, pickles), and their bytes would only teach the model noise.
    """
    docs, budget = [], max_bytes
    for f in files:
        data = f.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if data:
            docs.append(data[:budget])
            budget -= len(docs[-1])
        if budget == 0:
            break
    return docs


def _is_val(i: int, val_fraction: float) -> bool:
    # Document i is held out when it crosses a multiple of 1/val_fraction: every 20th file at 0.05.
    return int((i + 1) * val_fraction) > int(i * val_fraction)


def _to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def load_corpus(path: str | None = None, val_fraction: float = 0.05, max_bytes: int = 8 << 20) -> Corpus:
    """Load the corpus and split it into train and held-out val, by whole documents.

    A directory's files are documents, and every 1/val_fraction-th one goes to val, so no file is in both
    splits (with fewer files than that, the last one is held out). A single file is split by bytes: its last
    val_fraction goes to val.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}.")
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}.")
    if path is None:
        root, files = _stdlib_files()
        name = f"python-stdlib {sys.version.split()[0]} ({root})"
    else:
        root = Path(path).expanduser()
        if not root.exists():
            raise ValueError(f"data path '{root}' does not exist; pass an existing text file or directory.")
        files = _user_files(root)
        name = str(root)

    docs = _read_documents(files, max_bytes)
    total = sum(map(len, docs))
    if total == 0:
        raise ValueError(f"no UTF-8 text found in {name}; pass a text file or a directory of text files.")
    joined = DOC_SEPARATOR.join(docs)
    if len(docs) == 1:
        cut = len(joined) - max(1, int(len(joined) * val_fraction))
        train, val = joined[:cut], joined[cut:]
    else:
        held_out = [_is_val(i, val_fraction) for i in range(len(docs))]
        if not any(held_out):
            held_out[-1] = True
        train = DOC_SEPARATOR.join(d for d, v in zip(docs, held_out, strict=True) if not v)
        val = DOC_SEPARATOR.join(d for d, v in zip(docs, held_out, strict=True) if v)
    if len(train) < 2 or len(val) < 2:
        raise ValueError(f"{name} holds only {total} bytes of text, too few to split; pass a larger corpus.")

    capped = f", capped at {max_bytes / 2**20:.1f} MiB" if total == max_bytes else ""
    return Corpus(
        train=_to_tensor(train),
        val=_to_tensor(val),
        source=f"{name}, {len(docs)} of {len(files)} files, {total / 2**20:.2f} MiB{capped}",
        sha256=hashlib.sha256(joined).hexdigest(),
    )


def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return w[:, :-1], w[:, 1:]


def replica_shard(corpus: Corpus, replica: int, n_replicas: int) -> torch.Tensor:
    """The contiguous slice of the train split that replica `replica` of `n_replicas` trains on."""
    if not 0 <= replica < n_replicas:
        raise ValueError(f"replica must be in [0, {n_replicas}), got {replica}.")
    n = len(corpus.train)
    return corpus.train[replica * n // n_replicas : (replica + 1) * n // n_replicas]


def replica_batches(
    corpus: Corpus, replica: int, n_replicas: int, batch_size: int, seq_len: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets) of shape [batch_size, seq_len] drawn at random from this replica's shard.

    Disjoint shards give each replica its own data, as separate sites would have; the stream depends only on
    (seed, replica), so a restarted worker sees exactly the batches it saw before.
    """
    shard = replica_shard(corpus, replica, n_replicas)
    if len(shard) < seq_len + 1:
        raise ValueError(
            f"replica {replica}'s shard has {len(shard)} bytes, fewer than seq_len + 1 = {seq_len + 1}; "
            "pass more data, fewer replicas or a shorter sequence length."
        )
    # SeedSequence mixes (seed, replica) properly, so nearby seeds of different replicas never coincide.
    g = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, replica]).generate_state(1)[0]))
    while True:
        starts = torch.randint(0, len(shard) - seq_len, (batch_size,), generator=g)
        yield _windows(shard, starts, seq_len)


def validation_batches(
    corpus: Corpus, batch_size: int, seq_len: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Evenly spaced windows over the val split, not random: every rank, method and run sees the same."""
    if len(corpus.val) < seq_len + 1:
        raise ValueError(
            f"the val split has {len(corpus.val)} bytes, fewer than seq_len + 1 = {seq_len + 1}; "
            "pass more data or a shorter sequence length."
        )
    starts = torch.linspace(0, len(corpus.val) - seq_len - 1, batch_size * n_batches).long()
    return [_windows(corpus.val, s, seq_len) for s in starts.split(batch_size)]
