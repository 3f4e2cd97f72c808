"""The host-memory check: its estimate from parameter shapes, the limit it reads, and the sentence it refuses with."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from harness.errors import UserError
from harness.run.memory import (
    STATE_BYTES_PER_PARAMETER,
    available_bytes,
    check_fits,
    parameters_at_least,
    required_bytes,
)

GIB = 2**30


def test_required_bytes_counts_every_ranks_slice_of_the_model() -> None:
    shapes = [(1000, 100), (100,)]  # 100,100 parameters
    assert required_bytes(shapes, ranks=1, stages=1) == 100_100 * STATE_BYTES_PER_PARAMETER
    assert required_bytes(shapes, ranks=4, stages=2) == 4 * 50_050 * STATE_BYTES_PER_PARAMETER


def test_a_model_that_fits_passes_and_one_that_does_not_is_refused_with_the_estimate_and_the_limit() -> None:
    shapes = [(GIB // STATE_BYTES_PER_PARAMETER,)]  # about 1 GiB of state per rank
    needed = 2 * (GIB // STATE_BYTES_PER_PARAMETER) * STATE_BYTES_PER_PARAMETER
    check_fits(shapes, ranks=2, stages=1, available=needed)
    with pytest.raises(UserError) as refused:
        check_fits(shapes, ranks=2, stages=1, available=needed - 1)
    text = str(refused.value)
    assert "need at least 2 GiB" in text and "this host has 2 GiB available" in text, text
    assert "use a smaller --model, fewer --clusters or more --stages" in text


def test_no_limit_read_admits_every_model() -> None:
    check_fits([(10**12,)], ranks=2, stages=1, available=None)


def test_available_bytes_takes_the_lower_of_meminfo_and_the_cgroups_room(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    8000000 kB\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    assert available_bytes(meminfo, cgroup) == 8_000_000 * 1024
    (cgroup / "memory.max").write_text(f"{4 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{GIB}\n")
    assert available_bytes(meminfo, cgroup) == 3 * GIB
    (cgroup / "memory.max").write_text("max\n")
    assert available_bytes(meminfo, cgroup) == 8_000_000 * 1024
    assert available_bytes(tmp_path / "none", tmp_path / "none") is None


def _qwen2(tmp_path: Path, hidden: int, layers: int) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    fields = {"model_type": "qwen2", "hidden_size": hidden, "num_hidden_layers": layers,
              "intermediate_size": 4 * hidden, "vocab_size": 1000, "num_attention_heads": 4}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


def test_a_decoders_config_bounds_its_parameters_from_below_by_hand(tmp_path: Path) -> None:
    # embedding 1000 x 64, and per layer q and o (64 x 64 each) and two MLP matrices (64 x 256 each)
    assert parameters_at_least(str(_qwen2(tmp_path, 64, 2))) == 1000 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 256)
    assert parameters_at_least("tiny") is None and parameters_at_least(str(tmp_path / "missing")) is None
    (tmp_path / "odd.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 64}))
    assert parameters_at_least(str(tmp_path / "odd.json")) is None


def test_the_bound_is_below_the_built_models_count(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from trainers.models import get_model_config, parameter_shapes

    folder = _qwen2(tmp_path, 64, 2)
    built = sum(math.prod(shape) for shape in parameter_shapes(get_model_config(str(folder))))
    assert parameters_at_least(str(folder)) <= built


def test_a_decoder_far_too_large_is_refused_without_importing_transformers(tmp_path: Path) -> None:
    folder = _qwen2(tmp_path, 65536, 8)
    probe = (
        "import sys\n"
        "from harness.errors import UserError\n"
        "from harness.run.config import RunConfig\n"
        f"config = RunConfig.build('allreduce', '1gbps', model={str(folder)!r}, steps=10)\n"
        "try:\n    config.validate()\nexcept UserError as err:\n    print('REFUSED', err)\n"
        "print('TRANSFORMERS', 'transformers' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert "REFUSED the model has at least" in result.stdout and "TRANSFORMERS False" in result.stdout, (
        result.stdout + result.stderr
    )
