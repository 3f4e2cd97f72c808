"""Loss bounds the tests derive from the corpus, not from what a method happened to reach.

A model that predicts each byte from its frequency alone, ignoring context, is the best context-free model: on
training batches its cross-entropy is the training split's unigram entropy (3.14 nats on the first MiB of the
standard library's source the tests train on, against ln 256 = 5.55 for uniform bytes), and on held-out windows
it is the cross-entropy of those windows' bytes under the training split's frequencies. A loss below these means
the model learned to use context: "it learns", by a line that no method's result set.
"""

from __future__ import annotations

import functools
import math

import torch

from trainers.data import load_corpus, validation_batches

UNIFORM_BYTES_NATS = math.log(256)
TEST_CORPUS_BYTES = 1 << 20


@functools.cache
def _train_frequencies() -> torch.Tensor:
    ids = load_corpus(max_bytes=TEST_CORPUS_BYTES).train.long()
    # Add-one: a byte the training split never holds still has a finite loss.
    return (torch.bincount(ids, minlength=256).double() + 1) / (len(ids) + 256)


@functools.cache
def unigram_entropy_nats() -> float:
    """The training split's unigram entropy (nats per byte): the context-free loss on training batches."""
    ids = load_corpus(max_bytes=TEST_CORPUS_BYTES).train.long()
    p = torch.bincount(ids, minlength=256).double() / len(ids)
    p = p[p > 0]
    return float(-(p * p.log()).sum())


@functools.cache
def unigram_val_loss_nats(batch_size: int, seq_len: int, batches: int) -> float:
    """The context-free model's loss on exactly the held-out windows validation_batches gives a test."""
    corpus = load_corpus(max_bytes=TEST_CORPUS_BYTES)
    log_q = _train_frequencies().log()
    losses = [-log_q[y.long()].mean().item() for _, y in validation_batches(corpus, batch_size, seq_len, batches)]
    return sum(losses) / len(losses)
