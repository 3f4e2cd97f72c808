"""Plain casts: OpenDiLoCo sends its pseudo-gradients as fp16, summed on the wire in that dtype."""

from __future__ import annotations

from typing import Literal

import torch

CastDtype = Literal["fp16", "bf16", "fp32"]

CAST_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
