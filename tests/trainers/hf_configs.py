"""Transformers configs for the tests, written to a folder as a user would save them (config.save_pretrained).

The published shapes with 2 decoder layers and a 512-token vocabulary (the tests' trained BPE): OPT-125m's width
(768, 12 heads, FFN 3,072, 2,048 positions, embeddings tied as published) and Qwen2-0.5B's (896, 14 query and 2
key/value heads, FFN 4,864). `untied` unties the lm head, which pipeline stages need.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Skips the modules that import this one, with the reason, where the hf extra is not installed (a plain import
# aborted the whole session's collection).
AutoConfig = pytest.importorskip("transformers", reason="needs the hf extra (transformers)").AutoConfig

VOCAB = 512


def opt_125m(folder: Path, untied: bool = False, layers: int = 2) -> Path:
    AutoConfig.for_model(
        "opt",
        hidden_size=768,
        ffn_dim=3072,
        num_attention_heads=12,
        num_hidden_layers=layers,
        max_position_embeddings=2048,
        word_embed_proj_dim=768,
        vocab_size=VOCAB,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
        tie_word_embeddings=not untied,
    ).save_pretrained(folder)
    return folder


def qwen2_05b(folder: Path, untied: bool = False, layers: int = 2) -> Path:
    AutoConfig.for_model(
        "qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        vocab_size=VOCAB,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=not untied,
    ).save_pretrained(folder)
    return folder


def small(model_type: str, folder: Path, **fields) -> Path:
    """A narrow model of `model_type` for unit tests that build and compare whole models."""
    shapes = {
        "opt": dict(hidden_size=64, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=64),
        "qwen2": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
        "llama": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
        "gpt2": dict(n_embd=64, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0),
    }[model_type]
    layers = {"gpt2": "n_layer"}.get(model_type, "num_hidden_layers")
    AutoConfig.for_model(
        model_type, **{layers: 2, "vocab_size": VOCAB, "max_position_embeddings": 128, **shapes, **fields}
    ).save_pretrained(folder)
    return folder
