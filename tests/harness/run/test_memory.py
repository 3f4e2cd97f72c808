"""The host-memory check: its estimate from parameter shapes, the limit it reads, and the sentence it refuses with."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.errors import UserError
from harness.run.memory import STATE_BYTES_PER_PARAMETER, available_bytes, check_fits, required_bytes

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
