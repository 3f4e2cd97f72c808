import pytest
import torch

from trainers.data import (
    DOC_SEPARATOR,
    Corpus,
    load_corpus,
    replica_batches,
    replica_shard,
    validation_batches,
)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus()


def documents(split: torch.Tensor) -> set[bytes]:
    return set(bytes(split.tolist()).split(DOC_SEPARATOR))


def take(it, n):
    return [next(it) for _ in range(n)]


def test_default_corpus_is_the_stdlib_and_stable(corpus):
    assert corpus.source.startswith("python-stdlib")
    assert corpus.train.dtype == corpus.val.dtype == torch.uint8
    assert len(corpus.train) > 1_000_000
    assert 0.02 < len(corpus.val) / len(corpus.train) < 0.10
    assert load_corpus().sha256 == corpus.sha256


def test_train_and_val_share_no_document(corpus):
    val_docs = documents(corpus.val)
    assert len(val_docs) > 10
    assert not documents(corpus.train) & val_docs


def test_replica_shards_are_disjoint():
    # Shard 0 holds only bytes < 128 and shard 1 only bytes >= 128, so a window shows where it came from.
    gen = torch.Generator().manual_seed(0)
    train = torch.cat([torch.randint(lo, lo + 128, (10_000,), generator=gen) for lo in (0, 128)])
    corpus = Corpus(train.to(torch.uint8), torch.zeros(100, dtype=torch.uint8), "synthetic", "")
    for x, y in take(replica_batches(corpus, 0, 2, 8, 32, seed=0), 20):
        assert x.max() < 128 and y.max() < 128
    for x, y in take(replica_batches(corpus, 1, 2, 8, 32, seed=0), 20):
        assert x.min() >= 128 and y.min() >= 128


def test_replica_windows_come_from_their_own_shard(corpus):
    shard = bytes(replica_shard(corpus, 1, 3).tolist())
    x, y = next(replica_batches(corpus, 1, 3, 4, 64, seed=0))
    for row in torch.cat([x, y[:, -1:]], dim=1):
        assert bytes(row.tolist()) in shard


def test_batches_are_deterministic_per_seed_and_replica(corpus):
    def stream(replica, seed):
        return take(replica_batches(corpus, replica, 2, 4, 64, seed), 3)

    a, b = stream(0, seed=7), stream(0, seed=7)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))
    assert not torch.equal(a[0][0], stream(1, seed=7)[0][0])
    assert not torch.equal(a[0][0], stream(0, seed=8)[0][0])


def test_targets_are_inputs_shifted_by_one(corpus):
    x, y = next(replica_batches(corpus, 0, 1, 4, 64, seed=0))
    assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_validation_batches_are_fixed(corpus):
    a = validation_batches(corpus, 4, 64, 5)
    b = validation_batches(corpus, 4, 64, 5)
    assert len(a) == 5 and a[0][0].shape == (4, 64)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))
    assert torch.equal(a[0][0][:, 1:], a[0][1][:, :-1])


def test_user_directory_of_text_files(tmp_path):
    for i in range(5):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i}: " + "héllo wörld " * 200)
    (tmp_path / "image.bin").write_bytes(bytes([0xFF, 0xFE, 0x00]) * 100)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    corpus = load_corpus(str(tmp_path))
    assert "5 of 6 files" in corpus.source
    assert documents(corpus.val) == {(tmp_path / "doc4.txt").read_bytes()}
    assert not documents(corpus.train) & documents(corpus.val)
    x, y = next(replica_batches(corpus, 1, 2, 2, 32, seed=0))
    assert x.shape == (2, 32)


def test_user_single_file_holds_out_its_tail(tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("abcdefghij" * 1000)
    corpus = load_corpus(str(text), val_fraction=0.1)
    assert len(corpus.val) == 1000 and len(corpus.train) == 9000


def test_missing_or_empty_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no UTF-8 text"):
        load_corpus(str(tmp_path))
    (tmp_path / "short.txt").write_text("hi")
    with pytest.raises(ValueError, match="too few to split"):
        load_corpus(str(tmp_path))
    (tmp_path / "short.txt").write_text("a short text, " * 4)
    corpus = load_corpus(str(tmp_path))
    with pytest.raises(ValueError, match="shorter sequence length"):
        next(replica_batches(corpus, 0, 1, 1, 64, seed=0))
