"""Hugging Face transformers causal LMs, built from a local config and cut like the harness's own models.

`--model` names a directory holding config.json (and, optionally, model.safetensors) or a config JSON file. The
model is `AutoModelForCausalLM.from_config` (random init under the run's seed, so every replica starts equal without
a broadcast) or `from_pretrained` on the directory when it holds a safetensors checkpoint; nothing reaches a hub.

`HFDecoder` gives it the shape the trainers use for DecoderLM: `embed`, `blocks` and `head` that each map hidden
states to hidden states, so pipeline stages cut it at decoder-layer boundaries, and `forward(idx, targets)` returning
the mean cross-entropy. The families whose layers it knows how to call are SPLITTABLE; any other causal LM runs
whole (one stage per cluster). Attention runs through sdpa with no mask, which is causal: the harness never pads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_FILE = "config.json"
CHECKPOINT_FILE = "model.safetensors"
# model_type -> how its decoder is laid out; the Llama layout covers the families that share its layer call.
SPLITTABLE = {"opt": "opt", "llama": "llama", "qwen2": "llama", "qwen3": "llama", "mistral": "llama"}


@dataclass(frozen=True)
class HFModelConfig:
    """What the harness needs to know of a transformers config, read without building the model."""

    name: str  # the path as given
    config_path: Path
    checkpoint: Path | None  # model.safetensors beside config.json, loaded with from_pretrained
    model_type: str
    vocab_size: int
    n_layers: int
    max_seq_len: int
    tie_embeddings: bool
    config_json: str  # the config as read: hashable, and what is built

    @property
    def splittable(self) -> bool:
        return self.model_type in SPLITTABLE

    def transformers_config(self) -> Any:
        from transformers import AutoConfig

        _quiet_transformers()
        fields = json.loads(self.config_json)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _quiet_transformers() -> None:
    """Keep transformers' warnings off the console: the harness states what is wrong with a config in one sentence
    of its own, and the advice transformers prints on every rank (bos/eos ids outside a vocabulary the tokenizer
    resized) would bury it."""
    from transformers.utils import logging

    logging.set_verbosity_error()


def is_config_path(name: str) -> bool:
    """Whether `--model` names a transformers config rather than a built-in model (a path, or what looks like one)."""
    return "/" in name or name.endswith(".json") or Path(name).exists()


def load_config(name: str) -> HFModelConfig:
    """The transformers config at `name`; a hub id or any other name that is not a local path is refused."""
    path = Path(name).expanduser()
    if not path.exists():
        raise ValueError(
            f"model {name!r} is neither a built-in model nor a local path, and the harness never downloads; "
            f"pass a directory with {CONFIG_FILE} (or a config .json file) saved beforehand"
        )
    config_path = path / CONFIG_FILE if path.is_dir() else path
    if not config_path.is_file():
        raise ValueError(f"model directory {name!r} has no {CONFIG_FILE}; save the transformers config into it")
    try:
        fields = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"model config {str(config_path)!r} is not readable JSON ({err}); fix or replace it") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ValueError(f"model config {str(config_path)!r} has no model_type; save it with config.save_pretrained")
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError(
            f"model {name!r} is a transformers config, and transformers is not installed; install the harness's "
            "hf extra (pip install -e '.[hf]') or use a built-in model such as tiny"
        ) from None
    _quiet_transformers()
    from transformers import CONFIG_MAPPING, __version__

    if fields["model_type"] not in CONFIG_MAPPING:
        # transformers' own error lists every type it knows: 12 KB for one wrong word.
        raise ValueError(
            f"model config {str(config_path)!r} has model_type {fields['model_type']!r}, which transformers "
            f"{__version__} does not know; use a causal LM type it has, such as llama, qwen2, opt or gpt2"
        )
    try:
        # Fills the defaults a saved config may leave out (OPT's word_embed_proj_dim, Qwen2's rope settings).
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    except (ValueError, KeyError) as err:
        raise ValueError(f"model config {str(config_path)!r} is not one transformers can build: {err}") from None
    max_seq_len = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not max_seq_len:
        raise ValueError(f"model config {str(config_path)!r} states no max_position_embeddings; add it")
    checkpoint = config_path.parent / CHECKPOINT_FILE
    return HFModelConfig(
        name=name,
        config_path=config_path,
        checkpoint=checkpoint if path.is_dir() and checkpoint.is_file() else None,
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        n_layers=config.num_hidden_layers,
        max_seq_len=max_seq_len,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        config_json=json.dumps(config.to_dict(), sort_keys=True),
    )


def check_vocab(cfg: HFModelConfig, tokenizer_vocab_size: int) -> None:
    """A transformers model keeps its vocabulary; the tokenizer's ids must fit in it."""
    if tokenizer_vocab_size > cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer_vocab_size} tokens but model {cfg.name!r} embeds {cfg.vocab_size}; "
            f"use a smaller tokenizer or a config with vocab_size >= {tokenizer_vocab_size}"
        )


class _OPTEmbed(nn.Module):
    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.tokens, self.positions, self.project_in = decoder.embed_tokens, decoder.embed_positions, decoder.project_in

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx)
        if self.project_in is not None:
            x = self.project_in(x)
        position_ids = torch.arange(idx.shape[1], device=idx.device).expand(idx.shape[0], -1)
        return x + self.positions(None, position_ids=position_ids)


class _OPTBlock(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, attention_mask=None)


class _OPTHead(nn.Module):
    def __init__(self, decoder: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm, self.project_out, self.proj = decoder.final_layer_norm, decoder.project_out, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return self.proj(x)


class _LlamaBlock(nn.Module):
    """One decoder layer with the rotary angles it needs, recomputed per layer so that any cut runs on its own."""

    def __init__(self, layer: nn.Module, rotary: nn.Module):
        super().__init__()
        self.layer = layer
        # Held outside the module tree: it has only a non-persistent buffer, and registering it in every block
        # would list one module many times.
        self._rotary = (rotary,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        angles = self._rotary[0](x, position_ids)
        return self.layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=angles)


class _LlamaHead(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm, self.proj = norm, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class _Whole(nn.Module):
    """A family whose layers the harness does not call itself: the whole model as one part."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits


class HFDecoder(nn.Module):
    def __init__(self, cfg: HFModelConfig, model: nn.Module):
        super().__init__()
        self.cfg = cfg
        # Kept outside the module tree, whose names are the harness's (embed, blocks.N, head): the same parameters
        # under the transformers names, for saving with save_pretrained and for checking the cut against it.
        self._transformers_model = (model,)
        layout = SPLITTABLE.get(cfg.model_type)
        self.rotary: nn.Module | None = None
        if layout == "opt":
            decoder = model.model.decoder
            self.embed: nn.Module = _OPTEmbed(decoder)
            self.blocks = nn.ModuleList(_OPTBlock(layer) for layer in decoder.layers)
            self.head: nn.Module = _OPTHead(decoder, model.lm_head)
        elif layout == "llama":
            self.embed = model.model.embed_tokens
            self.rotary = model.model.rotary_emb  # registered once here, so .to(device) moves its buffer
            self.blocks = nn.ModuleList(_LlamaBlock(layer, self.rotary) for layer in model.model.layers)
            self.head = _LlamaHead(model.model.norm, model.lm_head)
        else:
            self.embed, self.blocks, self.head = _Whole(model), nn.ModuleList(), nn.Identity()

    @property
    def transformers_model(self) -> nn.Module:
        return self._transformers_model[0]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if idx.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds the model's max_seq_len {self.cfg.max_seq_len}")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build(cfg: HFModelConfig, load_weights: bool = True) -> HFDecoder:
    """The model, in float32 and training mode: from the checkpoint when there is one (and `load_weights`), else
    random under the seed."""
    from transformers import AutoModelForCausalLM

    if load_weights and cfg.checkpoint is not None:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.checkpoint.parent, local_files_only=True, attn_implementation="sdpa", dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_config(
            cfg.transformers_config(), attn_implementation="sdpa", dtype=torch.float32
        )
    model.train()
    return HFDecoder(cfg, model)
