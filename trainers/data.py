"""Offline training data: a byte-level corpus, per-replica shards and a fixed held-out split.

Nothing is downloaded. The default corpus is this Python's own standard library, which every machine running
the harness already has; `--data PATH` swaps in any text file or directory of text files.
"""

import functools
import hashlib
import itertools
import math
import os
import stat
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainers.documents import holds_records, read_text, records, source_files
from trainers.tokenizer import BYTE_VOCAB, BYTES, encode_corpus, parse_tokenizer

# Byte-level stand-in for <|endoftext|>: ASCII "end of transmission" never occurs in source code.
DOC_SEPARATOR = b"\x04"
# What load_corpus holds out and how much it reads; the workers call it with these defaults.
VAL_FRACTION = 0.05
MAX_BYTES = 8 << 20
# The JSONL/parquet/datasets field that holds a record's text (--data-field).
TEXT_FIELD = "text"
# --data-shift N cuts each replica's shard into this many contiguous segments and moves its batches to another one
# every N steps. 8 keeps each segment a run of neighbouring files (the default corpus: ~0.5 MiB of stdlib modules per
# segment with 2 clusters, ~120 KiB with 8), so segments differ in style, while 8 x 8 segments of the default corpus
# still hold the model's 1024-byte windows many times over.
SHIFT_SEGMENTS = 8


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # token ids (uint8 for bytes, int32 otherwise)
    val: torch.Tensor  # held-out token ids, disjoint from train
    source: str  # human-readable description of what was loaded and what is held out
    sha256: str  # of the concatenated bytes (train and val documents in file order)
    # UTF-8 bytes of each split (separators included), for bits per byte: loss per token x tokens / bytes.
    train_bytes: int = 0
    val_bytes: int = 0
    vocab_size: int = BYTE_VOCAB
    tokenizer: str = "bytes (256 tokens)"
    tokenizer_sha256: str = BYTES

    @property
    def val_tokens_per_byte(self) -> float:
        return len(self.val) / self.val_bytes

    def bits_per_byte(self, loss_per_token: float) -> float:
        """A held-out loss (nats per token) in bits per byte of text: comparable across tokenizers."""
        return loss_per_token * self.val_tokens_per_byte / math.log(2)


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


def _read_documents(
    files: list[Path], max_bytes: int, text_field: str = TEXT_FIELD
) -> tuple[list[tuple[Path, bytes]], list[Path]]:
    """Read sources in order until their documents hold max_bytes (the last one cut to fit), skipping empty ones.

    A text file is one document, a JSONL/parquet file or saved dataset one per record (trainers/documents.py).
    Non-UTF-8 text files are skipped rather than decoded with replacement: in a directory of text they are almost
    always binaries (images, archives, pickles), and their bytes would only teach the model noise.
    Returns the documents (with their sources) and the files skipped as not UTF-8.
    """
    docs, binary, budget = [], [], max_bytes
    for f in files:
        if holds_records(f):
            for text in records(f, text_field):
                data = text.encode()[:budget]
                if data:
                    docs.append((f, data))
                    budget -= len(data)
                if budget == 0:
                    break
        else:
            data = read_text(f, budget)
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


def _split(docs: list[bytes], val_fraction: float) -> tuple[list[bytes], list[bytes]]:
    """(train documents, val documents): whole documents, or a single one cut by bytes (see load_corpus)."""
    if len(docs) == 1:
        cut = len(docs[0]) - _single_file_val_bytes(len(docs[0]), val_fraction)
        return [docs[0][:cut]], [docs[0][cut:]]
    held_out = _held_out(len(docs), val_fraction)
    train = [d for d, v in zip(docs, held_out, strict=True) if not v]
    val = [d for d, v in zip(docs, held_out, strict=True) if v]
    return train, val


def _held_out_rule(n_docs: int, val_fraction: float) -> str:
    if n_docs == 1:
        return f"its last {val_fraction:.0%}"
    return f"every {round(1 / val_fraction)}th document" + (" (the last one here)" if n_docs * val_fraction < 1 else "")


def _to_tensor(ids: np.ndarray) -> torch.Tensor:
    # A copy: the ids may be a read-only view of a file or buffer, and torch wants memory it may write.
    return torch.from_numpy(np.array(ids))


def load_corpus(
    path: str | None = None,
    val_fraction: float = VAL_FRACTION,
    max_bytes: int = MAX_BYTES,
    tokenizer: str = BYTES,
    text_field: str = TEXT_FIELD,
) -> Corpus:
    """Load the corpus, split it into train and held-out val by whole documents, and encode both with `tokenizer`.

    A text file is a document, so is each record of a JSONL or parquet file or saved dataset (trainers/documents.py),
    and every 1/val_fraction-th document goes to val, so no document is in both splits (with fewer documents than
    that, the last one is held out). A single document is split by bytes: its last val_fraction goes to val.
    The tokenizer (trainers/tokenizer.py) sees each split's documents on their own; a BPE is trained on train only.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}.")
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}.")
    spec = parse_tokenizer(tokenizer)
    name, files, read = _documents(path, max_bytes, text_field)
    docs = [data for _, data in read]
    total = sum(map(len, docs))
    if total == 0:
        raise ValueError(f"no UTF-8 text found in {name}; pass a text file or a directory of text files.")
    train_docs, val_docs = _split(docs, val_fraction)
    train_bytes, val_bytes = _joined_length(train_docs), _joined_length(val_docs)
    if train_bytes < 2 or val_bytes < 2:
        raise ValueError(f"{name} holds only {total} bytes of text, too few to split; pass a larger corpus.")
    sha256 = _sha256(docs)
    encoded = encode_corpus(spec, train_docs, val_docs, sha256, DOC_SEPARATOR)

    capped = f", capped at {max_bytes / 2**20:.1f} MiB" if total == max_bytes else ""
    counted = (
        f"{len(docs)} of {len(files)} files"
        if not any(holds_records(f) for f in files)
        else (f"{len(docs)} documents from {len(set(f for f, _ in read))} of {len(files)} sources")
    )
    held_out = _held_out_rule(len(docs), val_fraction)
    return Corpus(
        train=_to_tensor(encoded.train),
        val=_to_tensor(encoded.val),
        source=f"{name}, {counted}, {total / 2**20:.2f} MiB{capped}; held out: {held_out}",
        sha256=sha256,
        train_bytes=train_bytes,
        val_bytes=val_bytes,
        vocab_size=encoded.vocab_size,
        tokenizer=encoded.description,
        tokenizer_sha256=encoded.sha256,
    )


def _documents(
    path: str | None, max_bytes: int, text_field: str
) -> tuple[str, list[Path] | tuple[Path, ...], list[tuple[Path, bytes]]]:
    """What load_corpus reads: the corpus's name, its files, and the documents read from them in order."""
    if path is None:
        root, files = _stdlib_files()
        name = f"python-stdlib {sys.version.split()[0]} ({root})"
    else:
        root = Path(path).expanduser()
        if not root.exists():
            raise ValueError(f"data path '{root}' does not exist; pass an existing text file or directory.")
        files = source_files(root)
        name = str(root)
    return name, files, _read_documents(files, max_bytes, text_field)[0]


def _sha256(docs: list[bytes]) -> str:
    return hashlib.sha256(DOC_SEPARATOR.join(docs)).hexdigest()


def corpus_sha256(path: str | None, text_field: str = TEXT_FIELD) -> str:
    """The hash load_corpus gives the corpus at `path` (Corpus.sha256) without encoding it: what the run read."""
    return _sha256([data for _, data in _documents(path, MAX_BYTES, text_field)[2]])


def _joined_length(docs: list[bytes]) -> int:
    return sum(map(len, docs)) + len(DOC_SEPARATOR) * max(0, len(docs) - 1)


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


def check_data(
    path: str | None,
    seq_len: int,
    n_replicas: int,
    data_shift: int = 0,
    tokenizer: str = BYTES,
    text_field: str = TEXT_FIELD,
) -> None:
    """Refuse, before anything starts, data the workers' load_corpus, replica_batches or validation_batches would
    refuse; raises ValueError with one sentence naming the fix.

    It reads and splits exactly what load_corpus does (at most MAX_BYTES; ~0.1 s on the default corpus), without
    building tensors: a path that exists and can be read, UTF-8 text in it, and enough of it that each of the
    n_replicas training shards and the val split hold one window of seq_len + 1 bytes (byte-level tokens, so
    bytes are tokens; batches and evaluation windows are drawn from those, overlapping, so their number needs
    no more). With data_shift > 0, each of a shard's SHIFT_SEGMENTS segments must hold such a window.
    A tokenizer other than bytes makes fewer tokens than bytes, so after the byte checks the corpus is encoded
    (trained and encoded once, then cached for the workers: trainers/tokenizer.py) and the windows checked in tokens.
    """
    parse_tokenizer(tokenizer)
    if seq_len < 1 or n_replicas < 1:
        raise ValueError(f"seq_len and n_replicas must be at least 1, got {seq_len} and {n_replicas}")
    if path is None:
        root, files = _stdlib_files()
        name = "the default corpus (this Python's standard library)"
    else:
        root, name = _check_data_path(path)
        files = source_files(root)
        if not files:
            raise ValueError(
                f"{name} holds no files (every file in it and its subfolders is read, whatever its extension, "
                "but hidden ones such as .git); add text files or pass another --data"
            )
    try:
        read, binary = _read_documents(files, MAX_BYTES, text_field)
    except OSError as err:
        what = err.filename or name
        where = f" in {name}" if path is not None and what != str(root) else ""
        raise ValueError(
            f"cannot read {what}{where} ({err.strerror}); make it readable or pass another --data"
        ) from None
    if not read:
        raise _no_text(name, root, files, binary, single_file=path is not None and root.is_file())

    docs = [data for _, data in read]
    train_docs, val_docs = _split(docs, VAL_FRACTION)
    train, val = _joined_length(train_docs), _joined_length(val_docs)
    need = seq_len + 1
    shard = min(stop - start for start, stop in (_shard_bounds(train, r, n_replicas) for r in range(n_replicas)))
    if shard >= need and val >= need:
        if data_shift > 0:
            _check_shift_segments(name, train, seq_len, n_replicas)
        if tokenizer != BYTES:
            _check_tokens(path, name, seq_len, n_replicas, data_shift, tokenizer, text_field)
        return
    raise _too_short(name, root, read, seq_len, n_replicas, shard, train, val)


def _no_text(name: str, root: Path, files: list[Path], binary: list[Path], single_file: bool) -> ValueError:
    """The error for data that holds files but no UTF-8 text in them."""
    if single_file:
        if binary:
            return ValueError(f"{name} is not UTF-8 text (it looks binary); pass a text file")
        return ValueError(f"{name} is empty; pass a file with text in it")
    if binary:
        what = f"{len(binary)} of its {len(files)} files are not UTF-8 text ({_examples(binary, root)})"
        what += ", the rest empty" if len(binary) < len(files) else ""
    else:
        what = f"its {len(files)} files are empty"
    return ValueError(f"{name} holds no text: {what}; add UTF-8 text files (any extension) or pass another --data")


def _too_short(
    name: str, root: Path, read: list, seq_len: int, n_replicas: int, shard: int, train: int, val: int
) -> ValueError:
    """The error for text too short for this run: the whole of it, a training shard, or the held-out split."""
    need = seq_len + 1
    shorter = "a shorter --seq-len or fewer --clusters" if n_replicas > 1 else "a shorter --seq-len"
    total = sum(len(data) for _, data in read)
    if len(read) == 1:
        least = _min_single_file_bytes(seq_len, n_replicas, VAL_FRACTION)
        more = f"at least {least:,} bytes of text" if least <= MAX_BYTES else "more text"
        shards = f"each of the {n_replicas} clusters' training shards" if n_replicas > 1 else "the training split"
        return ValueError(
            f"{name} holds {total:,} byte{'s' if total != 1 else ''} of text, too few for this run, which needs "
            f"seq_len + 1 = {need:,} bytes in {shards} and in the held-out last {VAL_FRACTION:.0%}; "
            f"pass {more}, or {shorter}"
        )
    if shard < need:
        return ValueError(
            f"{name}'s training split ({train:,} bytes) gives each of {n_replicas} clusters {shard:,} bytes, "
            f"fewer than seq_len + 1 = {need:,}; add text, or pass {shorter}"
        )
    held = [f for (f, _), v in zip(read, _held_out(len(read), VAL_FRACTION), strict=True) if v]
    every = round(1 / VAL_FRACTION)
    return ValueError(
        f"{name}'s held-out split ({_examples(held, root)}: {val:,} bytes) is shorter than the seq_len + 1 = "
        f"{need:,} that evaluation reads; add text to it or more files (every {every}th file is held out, or the "
        "last one when there are fewer), or pass a shorter --seq-len"
    )


def _check_tokens(
    path: str | None, name: str, seq_len: int, n_replicas: int, data_shift: int, tokenizer: str, text_field: str
) -> None:
    """The byte checks again in tokens, on the corpus as the workers will load it (encoded once, then cached)."""
    corpus = load_corpus(path, tokenizer=tokenizer, text_field=text_field)
    need = seq_len + 1
    bounds = [_shard_bounds(len(corpus.train), r, n_replicas) for r in range(n_replicas)]
    shard = min((_shortest_segment(stop - start) if data_shift else stop - start) for start, stop in bounds)
    if shard >= need and len(corpus.val) >= need:
        return
    part = "segment of a training shard" if data_shift else "training shard"
    raise ValueError(
        f"with --tokenizer {tokenizer}, {name} encodes to {len(corpus.train):,} training and {len(corpus.val):,} "
        f"held-out tokens, leaving the shortest {part} {shard:,}, and a window needs seq_len + 1 = {need:,}; "
        "add text or pass a shorter --seq-len"
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
