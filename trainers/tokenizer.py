"""Tokenizers: bytes (the default), a local tokenizer.json, or a byte-level BPE trained on the run's own corpus.

`bytes` needs nothing: a token is a byte, 256 of them. A tokenizer.json is loaded with the tokenizers library.
`bpe:N` trains a byte-level BPE of N tokens with the tokenizers library on the corpus's *training* split only (the
held-out split stays unseen), deterministically, so every rank and every host that trains it gets the same one.

What a tokenizer costs is paid once per corpus: the trained BPE and the corpus encoded by a tokenizer are cached in
the corpus's cache folder, keyed by the corpus's hash (`<cache>/corpora/<sha256[:16]>/`, where `<cache>` is
$HARNESS_CACHE_DIR, else $XDG_CACHE_HOME/harness, else ~/.cache/harness). A file lock makes the ranks of one host
that start together build it once; a changed corpus has another hash, so nothing stale is ever read.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

BYTES = "bytes"
BYTE_VOCAB = 256
# The document separator a trained BPE reserves (GPT-2's name for it); for a loaded tokenizer the first of these
# its vocabulary holds, else documents are joined by a blank line.
END_OF_TEXT = "<|endoftext|>"
END_TOKENS = (END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>")
# A byte-level BPE starts from the 256 bytes and the separator: fewer tokens than that learn no merge.
MIN_BPE_VOCAB = BYTE_VOCAB + 2
# Four times the largest vocabulary a published language model uses (262,144); the tokenizers library allocates
# for the vocabulary asked for up front (bpe:10000000000 asked it for 566 GB and aborted the process).
MAX_BPE_VOCAB = 2**20
# BPE training time grows with the square of the longest word (a run of bytes without whitespace): 10,000 bytes
# train in 0.03 s, 100,000 in 2 s and 1,000,000 in 260 s, all the while not answering Ctrl-C.
MAX_BPE_WORD_BYTES = 20_000
# Token ids are stored as int32: numpy's smallest type for any vocabulary a language model uses.
ID_DTYPE = np.int32


@dataclass(frozen=True)
class TokenizerSpec:
    """What --tokenizer asked for."""

    text: str
    kind: Literal["bytes", "file", "bpe"]
    path: Path | None = None
    bpe_vocab_size: int = 0


def parse_tokenizer(text: str) -> TokenizerSpec:
    """`bytes`, `bpe:N` or the path of a tokenizer.json; ValueError in one sentence otherwise."""
    if text == BYTES:
        return TokenizerSpec(text, "bytes")
    if text.startswith("bpe:"):
        count = text.removeprefix("bpe:")
        if not count.isdigit() or int(count) < MIN_BPE_VOCAB:
            raise ValueError(
                f"--tokenizer {text}: bpe:N needs a vocabulary N of at least {MIN_BPE_VOCAB} "
                f"(the 256 bytes, the separator and one merge), e.g. bpe:4096"
            )
        if int(count) > MAX_BPE_VOCAB:
            raise ValueError(
                f"--tokenizer {text}: bpe:N takes a vocabulary of at most {MAX_BPE_VOCAB:,} tokens (four times the "
                "largest a published language model uses), e.g. bpe:32768"
            )
        return TokenizerSpec(text, "bpe", bpe_vocab_size=int(count))
    path = Path(text).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"--tokenizer {text} is not bytes, bpe:N or an existing tokenizer.json; pass a local file "
            "(nothing is downloaded)"
        )
    return TokenizerSpec(text, "file", path=path)


def declared_vocab_size(spec: TokenizerSpec) -> int:
    """The vocabulary the model needs for this tokenizer, known before any training: ValueError for a bad file."""
    if spec.kind == "bytes":
        return BYTE_VOCAB
    if spec.kind == "bpe":
        return spec.bpe_vocab_size
    return _load_file(spec.path).get_vocab_size(with_added_tokens=True)


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ValueError(
            "--tokenizer other than bytes needs tokenizers; install it with pip install -e '.[hf]'"
        ) from None
    return tokenizers


def _load_file(path: Path) -> Any:
    try:
        return _tokenizers().Tokenizer.from_file(str(path))
    except ValueError:
        raise
    except Exception as err:
        raise ValueError(f"--tokenizer {path} is not a tokenizers JSON file ({err}); pass a tokenizer.json") from None


@dataclass(frozen=True)
class EncodedCorpus:
    """A corpus's splits as token ids, and what encoded them."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    description: str
    sha256: str  # of the tokenizer's JSON; "bytes" for bytes


def encode_corpus(
    spec: TokenizerSpec, train_docs: list[bytes], val_docs: list[bytes], corpus_sha256: str, separator: bytes
) -> EncodedCorpus:
    """The documents of each split encoded and joined by the separator token, from the cache where it has them."""
    if spec.kind == "bytes":
        return EncodedCorpus(
            np.frombuffer(separator.join(train_docs), dtype=np.uint8),
            np.frombuffer(separator.join(val_docs), dtype=np.uint8),
            BYTE_VOCAB,
            "bytes (256 tokens)",
            BYTES,
        )
    folder = corpus_cache(corpus_sha256)
    with _locked(folder):
        tokenizer = _load_file(spec.path) if spec.kind == "file" else _bpe(folder, spec.bpe_vocab_size, train_docs)
        json_text = tokenizer.to_str()
        tokenizer_sha = hashlib.sha256(json_text.encode()).hexdigest()
        ids_file = folder / f"ids-{tokenizer_sha[:16]}.npz"
        if ids_file.is_file():
            with np.load(ids_file) as cached:
                train, val = cached["train"], cached["val"]
        else:
            sep = _separator_ids(tokenizer)
            train, val = (_encode(tokenizer, docs, sep) for docs in (train_docs, val_docs))
            _write_atomic(ids_file, lambda fh: np.savez(fh, train=train, val=val))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    what = "byte-level BPE trained on the training split" if spec.kind == "bpe" else spec.path
    return EncodedCorpus(train, val, vocab, f"{what} ({vocab} tokens)", tokenizer_sha)


def cache_root() -> Path:
    if os.environ.get("HARNESS_CACHE_DIR"):
        return Path(os.environ["HARNESS_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "harness"


def corpus_cache(corpus_sha256: str) -> Path:
    return cache_root() / "corpora" / corpus_sha256[:16]


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _write_atomic(path: Path, write: Any) -> None:
    """Write to a temporary name and rename: a reader never sees half a file, even after a crash."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with partial.open("wb") as fh:
        write(fh)
    partial.replace(path)


def _bpe(folder: Path, vocab_size: int, train_docs: list[bytes]) -> Any:
    tokenizers = _tokenizers()
    path = folder / f"bpe-{vocab_size}.json"
    if path.is_file():
        return tokenizers.Tokenizer.from_file(str(path))
    _check_words(train_docs)
    byte_level = tokenizers.pre_tokenizers.ByteLevel
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = byte_level(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=byte_level.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    tokenizer.train_from_iterator((_text(d) for d in train_docs), trainer, length=len(train_docs))
    _write_atomic(path, lambda fh: fh.write(tokenizer.to_str().encode()))
    return tokenizer


def _check_words(docs: list[bytes]) -> None:
    """Refuses a corpus with a word longer than MAX_BPE_WORD_BYTES, whose training would not end in useful time."""
    too_long = re.compile(rb"\S{%d,}" % (MAX_BPE_WORD_BYTES + 1))
    for number, doc in enumerate(docs, 1):
        if match := too_long.search(doc):
            length = len(re.match(rb"\S*", doc[match.start() :]).group())
            raise ValueError(
                f"training document {number} holds {length:,} bytes without whitespace, and a BPE's training time "
                f"grows with the square of its longest word (at most {MAX_BPE_WORD_BYTES:,} bytes); break the text "
                "into lines or words, or use --tokenizer bytes"
            )


def _text(doc: bytes) -> str:
    # Documents are UTF-8 but for a character the byte budget may cut at the very end.
    return doc.decode("utf-8", errors="ignore")


def _separator_ids(tokenizer: Any) -> list[int]:
    for token in END_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return [token_id]
    return tokenizer.encode("\n\n", add_special_tokens=False).ids


def _encode(tokenizer: Any, docs: list[bytes], separator: list[int]) -> np.ndarray:
    buffer = io.BytesIO()
    for i, encoding in enumerate(tokenizer.encode_batch([_text(d) for d in docs], add_special_tokens=False)):
        if i:
            buffer.write(np.asarray(separator, dtype=ID_DTYPE).tobytes())
        buffer.write(np.asarray(encoding.ids, dtype=ID_DTYPE).tobytes())
    return np.frombuffer(buffer.getvalue(), dtype=ID_DTYPE)
