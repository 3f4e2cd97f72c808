"""Offline training data: a byte-level corpus, per-replica shards and a fixed held-out split.

Nothing is downloaded. The default corpus is this Python's own standard library, which every machine running
the harness already has; `--data PATH` swaps in any text file or directory of text files.
"""

import codecs
import functools
import hashlib
import itertools
import os
import stat
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# Byte-level stand-in for <|endoftext|>: ASCII "end of transmission" never occurs in source code.
DOC_SEPARATOR = b"\x04"
# What load_corpus holds out and how much it reads; the workers call it with these defaults.
VAL_FRACTION = 0.05
MAX_BYTES = 8 << 20
# --data-shift N cuts each replica's shard into this many contiguous segments and moves its batches to another one
# every N steps. 8 keeps each segment a run of neighbouring files (the default corpus: ~0.5 MiB of stdlib modules per
# segment with 2 clusters, ~120 KiB with 8), so segments differ in style, while 8 x 8 segments of the default corpus
# still hold the model's 1024-byte windows many times over.
SHIFT_SEGMENTS = 8


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8 token ids
    val: torch.Tensor  # uint8 held-out ids, disjoint from train
    source: str  # human-readable description of what was loaded
    sha256: str  # of the concatenated bytes (train and val documents in file order)


@functools.cache
def _stdlib_files() -> tuple[Path, tuple[Path, ...]]:
    """The standard library's .py files in a fixed order. Cached: every config's validation looks at them (a walk
    of ~1,800 files, a tenth of a second), and the installed standard library does not change under a process."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "site-packages"]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return root, tuple(sorted(files, key=lambda f: f.relative_to(root).as_posix()))


def _user_files(path: Path) -> list[Path]:
    """A file, or every file under a folder whatever its extension, but hidden ones (.git, .venv, editor state)."""
    if path.is_file():
        return [path]
    # Hidden entries are tooling, not text someone meant to train on.
    visible = (f for f in path.rglob("*") if not any(p.startswith(".") for p in f.relative_to(path).parts))
    return sorted((f for f in visible if f.is_file()), key=lambda f: f.relative_to(path).as_posix())


def _read_text(f: Path, limit: int) -> bytes | None:
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


def _read_documents(files: list[Path], max_bytes: int) -> tuple[list[tuple[Path, bytes]], list[Path]]:
    """Read files in order until they hold max_bytes (the last one cut to fit), skipping empty files.

    Non-UTF-8 files are skipped too, rather than decoded with replacement: in a directory of text they are
    almost always binaries (images, archives, pickles), and their bytes would only teach the model noise.
    Returns the documents (with their files) and the files skipped as not UTF-8.
    """
    docs, binary, budget = [], [], max_bytes
    for f in files:
        data = _read_text(f, budget)
        if data is None:
            binary.append(f)
            continue
        if data:
            docs.append((f, data))
            budget -= len(data)
        if budget == 0:
            break
    return docs, binary


def _is_val(i: int, val_fraction: float) -> bool:
    # Document i is held out when it crosses a multiple of 1/val_fraction: every 20th file at 0.05.
    return int((i + 1) * val_fraction) > int(i * val_fraction)


def _held_out(n_docs: int, val_fraction: float) -> list[bool]:
    """Which of n_docs (> 1) documents go to val: every 1/val_fraction-th, and at least the last one."""
    held_out = [_is_val(i, val_fraction) for i in range(n_docs)]
    if not any(held_out):
        held_out[-1] = True
    return held_out


def _single_file_val_bytes(length: int, val_fraction: float) -> int:
    """How many of a single document's `length` bytes are held out: its last val_fraction, at least one."""
    return max(1, int(length * val_fraction))


def _split(docs: list[bytes], val_fraction: float) -> tuple[bytes, bytes, bytes]:
    """(all documents joined, train, val), split as load_corpus documents."""
    joined = DOC_SEPARATOR.join(docs)
    if len(docs) == 1:
        cut = len(joined) - _single_file_val_bytes(len(joined), val_fraction)
        return joined, joined[:cut], joined[cut:]
    held_out = _held_out(len(docs), val_fraction)
    train = DOC_SEPARATOR.join(d for d, v in zip(docs, held_out, strict=True) if not v)
    val = DOC_SEPARATOR.join(d for d, v in zip(docs, held_out, strict=True) if v)
    return joined, train, val


def _to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def load_corpus(path: str | None = None, val_fraction: float = VAL_FRACTION, max_bytes: int = MAX_BYTES) -> Corpus:
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

    docs = [data for _, data in _read_documents(files, max_bytes)[0]]
    total = sum(map(len, docs))
    if total == 0:
        raise ValueError(f"no UTF-8 text found in {name}; pass a text file or a directory of text files.")
    joined, train, val = _split(docs, val_fraction)
    if len(train) < 2 or len(val) < 2:
        raise ValueError(f"{name} holds only {total} bytes of text, too few to split; pass a larger corpus.")

    capped = f", capped at {max_bytes / 2**20:.1f} MiB" if total == max_bytes else ""
    return Corpus(
        train=_to_tensor(train),
        val=_to_tensor(val),
        source=f"{name}, {len(docs)} of {len(files)} files, {total / 2**20:.2f} MiB{capped}",
        sha256=hashlib.sha256(joined).hexdigest(),
    )


def _min_single_file_bytes(seq_len: int, n_replicas: int, val_fraction: float) -> int:
    """The fewest bytes a single text file needs so that every replica's shard and the val split hold a window."""
    need = seq_len + 1
    length = max((n_replicas + 1) * need, int(need / val_fraction) - 2)
    while True:
        val = _single_file_val_bytes(length, val_fraction)
        if val >= need and _shard_bounds(length - val, 0, n_replicas)[1] >= need:
            return length
        length += 1


def _examples(paths: list[Path], root: Path, n: int = 3) -> str:
    shown = ", ".join(p.relative_to(root).as_posix() if root in p.parents else str(p) for p in paths[:n])
    return shown + (f" and {len(paths) - n} more" if len(paths) > n else "")


def check_data(path: str | None, seq_len: int, n_replicas: int, data_shift: int = 0) -> None:
    """Refuse, before anything starts, data the workers' load_corpus, replica_batches or validation_batches would
    refuse; raises ValueError with one sentence naming the fix.

    It reads and splits exactly what load_corpus does (at most MAX_BYTES; ~0.1 s on the default corpus), without
    building tensors: a path that exists and can be read, UTF-8 text in it, and enough of it that each of the
    n_replicas training shards and the val split hold one window of seq_len + 1 bytes (byte-level tokens, so
    bytes are tokens; batches and evaluation windows are drawn from those, overlapping, so their number needs
    no more). With data_shift > 0, each of a shard's SHIFT_SEGMENTS segments must hold such a window.
    """
    if seq_len < 1 or n_replicas < 1:
        raise ValueError(f"seq_len and n_replicas must be at least 1, got {seq_len} and {n_replicas}")
    if path is None:
        root, files = _stdlib_files()
        name = "the default corpus (this Python's standard library)"
    else:
        root, name = _check_data_path(path)
        files = _user_files(root)
        if not files:
            raise ValueError(
                f"{name} holds no files (every file in it and its subfolders is read, whatever its extension, "
                "but hidden ones such as .git); add text files or pass another --data"
            )
    try:
        read, binary = _read_documents(files, MAX_BYTES)
    except OSError as err:
        what = err.filename or name
        where = f" in {name}" if path is not None and what != str(root) else ""
        raise ValueError(
            f"cannot read {what}{where} ({err.strerror}); make it readable or pass another --data"
        ) from None
    if not read:
        if path is not None and root.is_file():
            if binary:
                raise ValueError(f"{name} is not UTF-8 text (it looks binary); pass a text file")
            raise ValueError(f"{name} is empty; pass a file with text in it")
        if binary:
            what = f"{len(binary)} of its {len(files)} files are not UTF-8 text ({_examples(binary, root)})"
            what += ", the rest empty" if len(binary) < len(files) else ""
        else:
            what = f"its {len(files)} files are empty"
        raise ValueError(f"{name} holds no text: {what}; add UTF-8 text files (any extension) or pass another --data")

    docs = [data for _, data in read]
    _, train, val = _split(docs, VAL_FRACTION)
    need = seq_len + 1
    shard = min(stop - start for start, stop in (_shard_bounds(len(train), r, n_replicas) for r in range(n_replicas)))
    if shard >= need and len(val) >= need:
        if data_shift > 0:
            _check_shift_segments(name, len(train), seq_len, n_replicas)
        return
    shorter = "a shorter --seq-len or fewer --clusters" if n_replicas > 1 else "a shorter --seq-len"
    total = sum(map(len, docs))
    if len(docs) == 1:
        least = _min_single_file_bytes(seq_len, n_replicas, VAL_FRACTION)
        more = f"at least {least:,} bytes of text" if least <= MAX_BYTES else "more text"
        shards = f"each of the {n_replicas} clusters' training shards" if n_replicas > 1 else "the training split"
        raise ValueError(
            f"{name} holds {total:,} byte{'s' if total != 1 else ''} of text, too few for this run, which needs "
            f"seq_len + 1 = {need:,} bytes in {shards} and in the held-out last {VAL_FRACTION:.0%}; "
            f"pass {more}, or {shorter}"
        )
    if shard < need:
        raise ValueError(
            f"{name}'s training split ({len(train):,} bytes) gives each of {n_replicas} clusters {shard:,} bytes, "
            f"fewer than seq_len + 1 = {need:,}; add text, or pass {shorter}"
        )
    held = [f for (f, _), v in zip(read, _held_out(len(docs), VAL_FRACTION), strict=True) if v]
    every = round(1 / VAL_FRACTION)
    raise ValueError(
        f"{name}'s held-out split ({_examples(held, root)}: {len(val):,} bytes) is shorter than the seq_len + 1 = "
        f"{need:,} that evaluation reads; add text to it or more files (every {every}th file is held out, or the "
        "last one when there are fewer), or pass a shorter --seq-len"
    )


def _check_shift_segments(name: str, train_bytes: int, seq_len: int, n_replicas: int) -> None:
    """Every replica's every --data-shift segment holds a window of seq_len + 1 bytes; else ValueError."""
    segment = min(
        _shortest_segment(stop - start)
        for start, stop in (_shard_bounds(train_bytes, r, n_replicas) for r in range(n_replicas))
    )
    if segment >= seq_len + 1:
        return
    shards = f"each of the {n_replicas} clusters' training shards" if n_replicas > 1 else "the training split"
    shorter = "a shorter --seq-len or fewer --clusters" if n_replicas > 1 else "a shorter --seq-len"
    raise ValueError(
        f"--data-shift cuts {shards} into {SHIFT_SEGMENTS} segments, and {name}'s training split "
        f"({train_bytes:,} bytes) leaves some of them only {segment:,} bytes, fewer than seq_len + 1 = "
        f"{seq_len + 1:,}; add text, pass {shorter}, or drop --data-shift"
    )


def _check_data_path(path: str) -> tuple[Path, str]:
    """(the path, how messages name it), when it is a readable file or folder; else ValueError."""
    root = Path(path).expanduser()
    try:
        mode = root.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(f"--data {path} does not exist; pass a text file or a folder of text files") from None
    except OSError as err:
        raise ValueError(f"cannot read --data {path} ({err.strerror}); pass a readable text file or folder") from None
    if stat.S_ISDIR(mode):
        if not os.access(root, os.R_OK | os.X_OK):
            raise ValueError(f"cannot read --data folder {path} (permission denied); make it readable")
        return root, f"--data folder {path}"
    if stat.S_ISREG(mode):
        if not os.access(root, os.R_OK):
            raise ValueError(f"cannot read --data {path} (permission denied); make it readable")
        return root, f"--data {path}"
    raise ValueError(f"--data {path} is neither a file nor a folder; pass a text file or a folder of text files")


def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return w[:, :-1], w[:, 1:]


def replica_shard(corpus: Corpus, replica: int, n_replicas: int) -> torch.Tensor:
    """The contiguous slice of the train split that replica `replica` of `n_replicas` trains on."""
    if not 0 <= replica < n_replicas:
        raise ValueError(f"replica must be in [0, {n_replicas}), got {replica}.")
    start, stop = _shard_bounds(len(corpus.train), replica, n_replicas)
    return corpus.train[start:stop]


def _shard_bounds(n: int, replica: int, n_replicas: int) -> tuple[int, int]:
    return replica * n // n_replicas, (replica + 1) * n // n_replicas


def _segment_bounds(n: int) -> list[tuple[int, int]]:
    """The SHIFT_SEGMENTS contiguous, disjoint [start, stop) ranges a shard of n bytes is cut into for --data-shift."""
    return [(j * n // SHIFT_SEGMENTS, (j + 1) * n // SHIFT_SEGMENTS) for j in range(SHIFT_SEGMENTS)]


def _shortest_segment(n: int) -> int:
    return min(stop - start for start, stop in _segment_bounds(n))


def shift_order(seed: int) -> list[int]:
    """The order in which --data-shift visits a shard's segments: phase p uses shift_order(seed)[p % SHIFT_SEGMENTS].

    A permutation drawn from the seed alone, so every replica moves to the same relative segment of its own shard
    at the same step, consecutive phases always use different (disjoint) segments, and after SHIFT_SEGMENTS phases
    the cycle repeats.
    """
    # spawn_key keeps this draw apart from the replicas' batch streams, which are seeded from (seed, replica).
    state = int(np.random.SeedSequence(seed, spawn_key=(1,)).generate_state(1)[0])
    return torch.randperm(SHIFT_SEGMENTS, generator=torch.Generator().manual_seed(state)).tolist()


def data_phase(step: int, data_shift: int) -> int:
    """Which --data-shift phase step `step` (from 0) belongs to: the data changes every data_shift steps."""
    return step // data_shift


def replica_batches(
    corpus: Corpus,
    replica: int,
    n_replicas: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    data_shift: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets) of shape [batch_size, seq_len] drawn at random from this replica's shard.

    Disjoint shards give each replica its own data, as separate sites would have; the stream depends only on
    (seed, replica), so a restarted worker sees exactly the batches it saw before.

    With data_shift = N > 0 the shard is cut into SHIFT_SEGMENTS contiguous segments and batch i (one per step) is
    drawn from segment shift_order(seed)[(i // N) % SHIFT_SEGMENTS] only: every N batches the stream moves to a
    different part of the corpus. A bad setting raises ValueError here, not at the first batch.
    """
    shard = replica_shard(corpus, replica, n_replicas)
    if len(shard) < seq_len + 1:
        raise ValueError(
            f"replica {replica}'s shard has {len(shard)} bytes, fewer than seq_len + 1 = {seq_len + 1}; "
            "pass more data, fewer replicas or a shorter sequence length."
        )
    if data_shift < 0:
        raise ValueError(f"data_shift must be 0 (off) or a positive number of steps, got {data_shift}.")
    segment = _shortest_segment(len(shard))
    if data_shift > 0 and segment < seq_len + 1:
        raise ValueError(
            f"replica {replica}'s shard of {len(shard)} bytes cut into {SHIFT_SEGMENTS} --data-shift segments leaves "
            f"some only {segment} bytes, fewer than seq_len + 1 = {seq_len + 1}; pass more data, fewer replicas, "
            "a shorter sequence length or no --data-shift."
        )
    # SeedSequence mixes (seed, replica) properly, so nearby seeds of different replicas never coincide.
    g = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, replica]).generate_state(1)[0]))
    if data_shift == 0:
        # Every batch from the whole shard: the same stream as before --data-shift existed.
        return _draw([shard], batch_size, seq_len, g, itertools.repeat(0))
    segments = [shard[start:stop] for start, stop in _segment_bounds(len(shard))]
    order = shift_order(seed)
    # data_shift batches (steps) from each segment in turn, in shift_order, cycling.
    plan = (order[phase % SHIFT_SEGMENTS] for phase in itertools.count() for _ in range(data_shift))
    return _draw(segments, batch_size, seq_len, g, plan)


def _draw(
    sources: list[torch.Tensor], batch_size: int, seq_len: int, g: torch.Generator, plan: Iterator[int]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches of random windows, batch i from sources[j] for the i-th j of plan."""
    for j in plan:
        starts = torch.randint(0, len(sources[j]) - seq_len, (batch_size,), generator=g)
        yield _windows(sources[j], starts, seq_len)


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
