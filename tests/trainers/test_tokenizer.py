"""Tokenizers: bytes, a trained byte-level BPE (cached by the corpus's hash), a tokenizer.json; bits per byte."""

import math

import numpy as np
import pytest

from trainers.config import TrainConfig
from trainers.data import check_data, load_corpus
from trainers.tokenizer import BYTE_VOCAB, MAX_BPE_WORD_BYTES, corpus_cache, declared_vocab_size, parse_tokenizer

pytest.importorskip("tokenizers")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def text(tmp_path):
    """A small corpus of 60 documents: enough for a 512-token BPE to learn merges."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(60):
        (folder / f"{i:02}.py").write_text(f"def function_{i}(value):\n    return value * {i} + len('spam eggs')\n" * 8)
    return str(folder)


def test_bytes_is_the_identity_and_its_bits_per_byte_the_loss_in_bits(text):
    corpus = load_corpus(text)
    assert corpus.vocab_size == BYTE_VOCAB and corpus.tokenizer_sha256 == "bytes"
    assert corpus.val_tokens_per_byte == 1
    assert corpus.bits_per_byte(math.log(2)) == pytest.approx(1.0)


def test_a_512_token_bpe_is_trained_on_the_training_split_cached_and_used(text, cache):
    corpus = load_corpus(text, tokenizer="bpe:512")
    # A small corpus runs out of pairs to merge before 512; the model still embeds the 512 declared.
    assert BYTE_VOCAB < corpus.vocab_size <= 512 and corpus.train.dtype.is_floating_point is False
    assert TrainConfig(tokenizer="bpe:512").model_config().vocab_size == 512
    assert int(corpus.train.max()) < 512 and int(corpus.val.max()) < 512
    # Merges make fewer tokens than bytes, and bits per byte scale the loss by that.
    assert corpus.val_tokens_per_byte < 0.6
    assert corpus.bits_per_byte(1.0) == pytest.approx(corpus.val_tokens_per_byte / math.log(2))
    folder = corpus_cache(corpus.sha256)
    assert (folder / "bpe-512.json").is_file() and list(folder.glob("ids-*.npz"))
    again = load_corpus(text, tokenizer="bpe:512")
    assert again.tokenizer_sha256 == corpus.tokenizer_sha256
    assert np.array_equal(again.train.numpy(), corpus.train.numpy())


def test_the_bpe_is_retrained_from_scratch_to_the_same_one(text, cache, tmp_path, monkeypatch):
    first = load_corpus(text, tokenizer="bpe:512")
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert load_corpus(text, tokenizer="bpe:512").tokenizer_sha256 == first.tokenizer_sha256


def test_the_bpe_never_sees_the_held_out_split(text, tmp_path, monkeypatch):
    """A word only in a held-out document is not a token of the trained BPE."""
    held_out = sorted((tmp_path / "corpus").iterdir())[19]  # every 20th document: the 20th file
    held_out.write_text("zyzzyvazyzzyva " * 200)
    corpus = load_corpus(text, tokenizer="bpe:512")
    from tokenizers import Tokenizer

    bpe = Tokenizer.from_file(str(corpus_cache(corpus.sha256) / "bpe-512.json"))
    assert len(bpe.encode("zyzzyva").ids) > 3


def test_a_tokenizer_json_is_loaded_and_its_vocabulary_declared(text, tmp_path):
    trained = load_corpus(text, tokenizer="bpe:300")
    path = corpus_cache(trained.sha256) / "bpe-300.json"
    spec = parse_tokenizer(str(path))
    assert spec.kind == "file" and declared_vocab_size(spec) == 300
    corpus = load_corpus(text, tokenizer=str(path))
    assert np.array_equal(corpus.train.numpy(), trained.train.numpy())


def test_check_data_counts_windows_in_tokens(text):
    check_data(text, 64, 2, tokenizer="bpe:512")
    # Enough bytes for a 1,000-token window, not enough tokens once merged.
    with pytest.raises(ValueError, match="with --tokenizer bpe:512, .* encodes to .* a window needs seq_len"):
        check_data(text, 1000, 2, tokenizer="bpe:512")


@pytest.mark.parametrize(
    "text, message",
    [
        ("bpe:abc", "bpe:N needs a vocabulary N of at least 258"),
        ("bpe:257", "at least 258"),
        # The tokenizers library allocates for the vocabulary asked for: this one aborted the process (566 GB).
        ("bpe:10000000000", "bpe:N takes a vocabulary of at most 1,048,576 tokens"),
        ("nope.json", "is not bytes, bpe:N or an existing tokenizer.json"),
    ],
)
def test_bad_tokenizers_are_refused_in_one_sentence(text, message):
    with pytest.raises(ValueError, match=message):
        parse_tokenizer(text)


def test_a_word_too_long_to_train_on_is_refused_before_training(tmp_path):
    """A 50 MB line without a space kept BPE training busy (and deaf to Ctrl-C) for longer than anyone waits."""
    corpus = tmp_path / "long.txt"
    word = (b"abcdefgh" * 2_600)[: MAX_BPE_WORD_BYTES + 1]
    corpus.write_bytes(b"short words here\n" * 3_000 + word + b"\n" + b"more short words\n" * 3_000)
    with pytest.raises(ValueError, match=r"training document 1 holds 20,001 bytes without whitespace.*break the text"):
        load_corpus(str(corpus), tokenizer="bpe:512")
    corpus.write_bytes(b"short words here\n" * 3_000 + word[:-1] + b"\n" + b"more short words\n" * 3_000)
    assert load_corpus(str(corpus), tokenizer="bpe:512").vocab_size > BYTE_VOCAB
