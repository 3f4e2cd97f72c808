"""check_data refuses exactly what the workers' loading would fail on, cheaply, before anything starts."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from trainers.data import (
    MAX_BYTES,
    _min_single_file_bytes,
    check_data,
    load_corpus,
    replica_batches,
    validation_batches,
)
from trainers.documents import read_text

REPO = Path(__file__).resolve().parents[2]


def loads(path, seq_len: int, replicas: int) -> bool:
    """What a worker does with the data: load it, draw a batch on every replica, build the evaluation batches."""
    try:
        corpus = load_corpus(path)
        for r in range(replicas):
            next(replica_batches(corpus, r, replicas, 2, seq_len, seed=0))
        validation_batches(corpus, 2, seq_len, 3)
    except ValueError:
        return False
    return True


def checks(path, seq_len: int, replicas: int) -> bool:
    try:
        check_data(path, seq_len, replicas)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("seq_len", "replicas"), [(1, 1), (16, 1), (16, 3), (64, 2), (128, 8)])
def test_the_single_file_minimum_is_exact(tmp_path, seq_len, replicas):
    least = _min_single_file_bytes(seq_len, replicas, 0.05)
    path = tmp_path / "book.txt"
    for length in (least - 1, least):
        path.write_text("w" * length)
        assert checks(str(path), seq_len, replicas) == loads(str(path), seq_len, replicas) == (length == least)


@pytest.mark.parametrize(
    "sizes",
    [[5000, 10], [10, 5000], [100, 5000], [300] * 19 + [64], [300] * 19 + [65], [70] * 25, [1, 1, 1]],
)
@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_a_folder_passes_exactly_when_the_workers_could_load_it(tmp_path, sizes, replicas):
    for i, n in enumerate(sizes):
        (tmp_path / f"doc{i:02d}.txt").write_text("t" * n)
    assert checks(str(tmp_path), 64, replicas) == loads(str(tmp_path), 64, replicas)


def test_binaries_in_a_folder_are_skipped_as_the_loader_skips_them(tmp_path):
    (tmp_path / "a.txt").write_text("text " * 400)
    (tmp_path / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" * 50)
    (tmp_path / "c.txt").write_text("more " * 400)
    check_data(str(tmp_path), 64, 2)
    assert "2 of 3 files" in load_corpus(str(tmp_path)).source


def test_a_binary_file_is_named(tmp_path):
    path = tmp_path / "weights.pt"
    path.write_bytes(bytes(range(256)) * 100)
    with pytest.raises(ValueError, match=rf"^--data {path} is not UTF-8 text \(it looks binary\); pass a text file$"):
        check_data(str(path), 64, 2)


def test_only_the_bytes_used_are_read_and_decoded(tmp_path):
    path = tmp_path / "big.txt"
    # UTF-8 text up to the budget, then a multi-byte character cut by it, then bytes that are not UTF-8 at all.
    path.write_bytes(b"a" * 9 + "é".encode() + b"\xff" * 10)
    assert read_text(path, 10) == b"a" * 9 + b"\xc3"
    assert read_text(path, 100) is None


def test_a_large_file_costs_no_more_than_the_budget(tmp_path):
    path = tmp_path / "huge.txt"
    with path.open("wb") as f:
        f.truncate(4 * MAX_BYTES)  # sparse: zeros are valid UTF-8
    start = time.perf_counter()
    check_data(str(path), 128, 2)
    assert time.perf_counter() - start < 1.0


def test_the_default_corpus_is_checked_quickly():
    check_data(None, 128, 2)  # warm the page cache, as a second run would find it
    start = time.perf_counter()
    check_data(None, 1024, 8)
    assert time.perf_counter() - start < 1.0


def test_an_unreadable_file_in_a_folder_is_named():
    """Root reads every file, and CI runs as root: there the check runs as user nobody, in a child."""
    folder = Path(tempfile.mkdtemp(prefix="harness-unreadable-", dir="/tmp"))
    try:
        folder.chmod(0o755)
        (folder / "a.txt").write_text("text " * 400)
        secret = folder / "secret.txt"
        secret.write_text("text " * 400)
        secret.chmod(0)
        code = (
            "from trainers.data import check_data\n"
            "try:\n"
            f"    check_data({str(folder)!r}, 64, 2)\n"
            "except ValueError as err:\n"
            "    print(err)\n"
        )
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        site = next(Path(sys.prefix, "lib").glob("python3*/site-packages"))
        env = {"PATH": os.environ["PATH"], "HOME": str(folder), "PYTHONPATH": f"{REPO}:{site}"}
        result = subprocess.run(
            [*as_nobody, sys.executable, "-c", code], capture_output=True, text=True, cwd=folder, env=env, timeout=120
        )
        if result.returncode != 0 and "import" in result.stderr.lower():
            pytest.skip(f"user nobody cannot import the harness here: {result.stderr.strip()[-200:]}")
        assert result.returncode == 0, result.stderr
        assert re.search(r"cannot read .*secret.txt.*make it readable", result.stdout), result.stdout
    finally:
        shutil.rmtree(folder)
