"""Decoder-only language models in two flavours, small enough to read in one sitting.

opt:  learned positions, LayerNorm, ReLU MLP, biases everywhere (OPT-125m / OPT-1.3B shapes).
qwen: rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, bias only on q/k/v (Qwen1.5 shapes).

The model is split into `embed`, `blocks` and `head` so that pipeline stages can be cut as
[embed, blocks[:k]] ... [blocks[k:], head]: every part maps hidden states to hidden states on its own,
which is why rotary angles are recomputed inside each attention layer rather than cached in the parent.

`--model` may also name a local transformers config (trainers/hf_models.py): the functions below take either
kind of config, so the trainers, the pipeline and the projections never ask which it is.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from trainers.hf_models import HFDecoder, HFModelConfig

OPT_POSITION_OFFSET = 2  # OPT reserves the first two rows of its position table (a fairseq legacy)
ROPE_THETA = 1_000_000.0  # Qwen1.5's rope_theta


@dataclass(frozen=True)
class ModelConfig:
    name: str
    style: Literal["opt", "qwen"]
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    tie_embeddings: bool  # lm head shares the token embedding weight

    def __post_init__(self) -> None:
        if self.style not in ("opt", "qwen"):
            raise ValueError(f"model {self.name!r}: style must be 'opt' or 'qwen', got {self.style!r}")
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"model {self.name!r}: n_heads must divide d_model and n_kv_heads n_heads")
        if self.style == "qwen" and (self.d_model // self.n_heads) % 2:
            raise ValueError(f"model {self.name!r}: rotary embeddings need an even head dimension")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def splittable(self) -> bool:
        """Whether pipeline stages can cut it at block boundaries: always, for the harness's own models."""
        return True


MODEL_CONFIGS: dict[str, ModelConfig] = {
    cfg.name: cfg
    for cfg in (
        # name, style, vocab, d_model, layers, heads, kv heads, d_ff, max_seq_len
        ModelConfig("tiny", "opt", 256, 128, 4, 4, 4, 512, 128, tie_embeddings=False),
        ModelConfig("small", "opt", 256, 384, 6, 6, 6, 1536, 256, tie_embeddings=False),
        ModelConfig("tiny-qwen", "qwen", 256, 128, 4, 4, 2, 384, 128, tie_embeddings=False),
        ModelConfig("opt-125m", "opt", 50272, 768, 12, 12, 12, 3072, 2048, tie_embeddings=True),
        ModelConfig("opt-1.3b", "opt", 50272, 2048, 24, 32, 32, 8192, 2048, tie_embeddings=True),
        # DiLoCoX trains "Qwen1.5-107B"; no such checkpoint is published, so we take Qwen1.5-110B's shape.
        # For projection only (count_parameters gives 111,209,914,368); never instantiate it.
        ModelConfig("qwen1.5-107b", "qwen", 152064, 8192, 80, 64, 8, 49152, 32768, tie_embeddings=False),
    )
}


def get_model_config(name: str) -> ModelConfig | HFModelConfig:
    """A built-in model by name, or the transformers config at a local path."""
    from trainers import hf_models

    if name in MODEL_CONFIGS:
        return MODEL_CONFIGS[name]
    if hf_models.is_config_path(name):
        return hf_models.load_config(name)
    raise ValueError(
        f"unknown model {name!r}; known: {', '.join(MODEL_CONFIGS)}, or a local directory with a transformers "
        f"config.json"
    )


def with_vocab(cfg: ModelConfig | HFModelConfig, tokenizer_vocab_size: int) -> ModelConfig | HFModelConfig:
    """The model for a tokenizer: a built-in one takes its vocabulary; a transformers one keeps its own, which
    must hold the tokenizer's ids."""
    if isinstance(cfg, ModelConfig):
        return dataclasses.replace(cfg, vocab_size=tokenizer_vocab_size)
    from trainers.hf_models import check_vocab

    check_vocab(cfg, tokenizer_vocab_size)
    return cfg


def build_model(cfg: ModelConfig | HFModelConfig) -> DecoderLM | HFDecoder:
    if isinstance(cfg, ModelConfig):
        return DecoderLM(cfg)
    from trainers.hf_models import build

    return build(cfg)


def count_parameters(cfg: ModelConfig | HFModelConfig) -> int:
    """Parameter count from the shape alone (tied weights once); equals sum(p.numel()) of build_model(cfg)."""
    if not isinstance(cfg, ModelConfig):
        return sum(shape.numel() for shape in parameter_shapes(cfg))
    d, ff = cfg.d_model, cfg.d_ff
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    qkv = d * q + q + 2 * (d * kv + kv)
    if cfg.style == "opt":
        norm = 2 * d  # weight and bias
        block = qkv + q * d + d + (d * ff + ff) + (ff * d + d) + 2 * norm
        positions = (cfg.max_seq_len + OPT_POSITION_OFFSET) * d
    else:
        norm = d
        block = qkv + q * d + 3 * d * ff + 2 * norm
        positions = 0
    tokens = cfg.vocab_size * d
    lm_head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return tokens + positions + cfg.n_layers * block + norm + lm_head


def make_norm(cfg: ModelConfig) -> nn.Module:
    return nn.LayerNorm(cfg.d_model, eps=1e-5) if cfg.style == "opt" else nn.RMSNorm(cfg.d_model, eps=1e-6)


def apply_rope(x: torch.Tensor) -> torch.Tensor:
    """Rotate [B, H, T, head_dim] by position, in Qwen's rotate-half layout."""
    T, hd = x.shape[-2], x.shape[-1]
    # Angles in float32 and from scratch each call: a cached buffer would be cast along with a bf16 model
    # and lose the precision long positions need; the cost is a [T, hd/2] outer product.
    inv_freq = ROPE_THETA ** -(torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rotary = cfg.style == "qwen"
        self.q = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim)
        self.k = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim)
        self.v = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.style == "opt")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.rotary:
            q, k = apply_rope(q), apply_rope(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads < self.n_heads)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class ReluMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm transformer block (OPT-125m/1.3B and Qwen both normalize before each sublayer)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = ReluMLP(cfg) if cfg.style == "opt" else SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.max_seq_len = cfg.max_seq_len
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = (
            nn.Embedding(cfg.max_seq_len + OPT_POSITION_OFFSET, cfg.d_model) if cfg.style == "opt" else None
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's max_seq_len {self.max_seq_len}")
        x = self.tokens(idx)
        if self.positions is not None:
            x = x + self.positions(torch.arange(T, device=idx.device) + OPT_POSITION_OFFSET)
        return x


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = make_norm(cfg)
        self.proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.head = Head(cfg)
        if cfg.tie_embeddings:
            self.head.proj.weight = self.embed.tokens.weight
        self.apply(self._init_weights)
        # Residual projections add into the stream once per sublayer; scaling them (GPT-2) keeps the
        # variance of the residual stream from growing with depth.
        for block in self.blocks:
            for proj in (block.attn.o, block.mlp.down):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class _NoNormalInit(TorchFunctionMode):
    """Skips normal_ initialization: a meta tensor holds no values, and torch's meta normal_ is a Python
    decomposition whose first call imports torch._dynamo (4 s of a loaded core, in the harness's every run)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.normal_ or func is nn.init.normal_:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def parameter_shapes(cfg: ModelConfig | HFModelConfig) -> tuple[torch.Size, ...]:
    """The model's parameter shapes, built on the meta device: no memory, so the 107B shape works too."""
    from trainers import hf_models

    with torch.device("meta"), _NoNormalInit():
        model = DecoderLM(cfg) if isinstance(cfg, ModelConfig) else hf_models.build(cfg, load_weights=False)
        return tuple(p.shape for p in model.parameters())
